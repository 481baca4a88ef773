"""OutputProcessor: turns EngineCoreOutputs into user-facing RequestOutputs and tracks per-request metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvflow.outputs import CompletionOutput, RequestMetrics, RequestOutput

if TYPE_CHECKING:
    from kvflow.core.sched.output import EngineCoreOutput
    from kvflow.sampling_params import SamplingParams


@dataclass
class RequestState:
    """Client-side state of one request: what has been emitted so far, and its metrics."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    metrics: RequestMetrics
    output_token_ids: list[int] = field(default_factory=list)
    num_emitted_tokens: int = 0  # for output_kind="delta"


class OutputProcessor:
    """Accumulates each request's tokens and builds `RequestOutput`s according to its `output_kind`.

    Invariant: a request is tracked from `add_request` until its finished output (or `abort_requests`); the
    finished output is produced exactly once.
    """

    def __init__(self) -> None:
        self.request_states: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    sampling_params: SamplingParams, arrival_time: float | None = None) -> None:
        if request_id in self.request_states:
            raise ValueError(f"request id {request_id!r} is already in use")
        metrics = RequestMetrics(arrival_time=arrival_time if arrival_time is not None else time.monotonic())
        self.request_states[request_id] = RequestState(request_id, prompt, list(prompt_token_ids),
                                                       sampling_params, metrics)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def process_outputs(self, engine_core_outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        """Apply one step's outputs; returns the RequestOutputs to deliver (per each request's output_kind)."""
        now = time.monotonic()
        request_outputs = []
        for engine_output in engine_core_outputs:
            state = self.request_states.get(engine_output.request_id)
            if state is None:
                continue  # aborted on this side already
            if engine_output.new_token_ids and state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            state.output_token_ids.extend(engine_output.new_token_ids)
            state.metrics.num_cached_tokens = engine_output.num_cached_tokens
            finished = engine_output.finished
            if finished:
                state.metrics.finished_time = now
                del self.request_states[engine_output.request_id]
            request_output = self._make_output(state, engine_output.finish_reason, engine_output.stop_reason,
                                               finished)
            if request_output is not None:
                request_outputs.append(request_output)
        return request_outputs

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        """Finish requests with finish_reason "abort"; returns their final outputs (partial tokens kept)."""
        outputs = []
        for request_id in request_ids:
            state = self.request_states.pop(request_id, None)
            if state is not None:
                state.metrics.finished_time = time.monotonic()
                output = self._make_output(state, "abort", None, finished=True)
                if output is not None:
                    outputs.append(output)
        return outputs

    @staticmethod
    def _make_output(state: RequestState, finish_reason: str | None, stop_reason: int | str | None,
                     finished: bool) -> RequestOutput | None:
        output_kind = state.sampling_params.output_kind
        if output_kind == "final_only" and not finished:
            return None
        if output_kind == "delta":
            token_ids = state.output_token_ids[state.num_emitted_tokens:]
            state.num_emitted_tokens = len(state.output_token_ids)
        else:
            token_ids = list(state.output_token_ids)
        completion = CompletionOutput(index=0, text="", token_ids=token_ids,
                                      finish_reason=finish_reason if finished else None,
                                      stop_reason=stop_reason if finished else None)
        return RequestOutput(request_id=state.request_id, prompt=state.prompt,
                             prompt_token_ids=state.prompt_token_ids, outputs=[completion], finished=finished,
                             metrics=state.metrics)
