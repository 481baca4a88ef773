"""OutputProcessor: turns EngineCoreOutputs into user-facing RequestOutputs.

It detokenizes incrementally, applies stop strings (the engine core only knows token ids, so a stop-string match
is reported back as a request to abort in the core), converts logprobs, folds the `n` child requests of a
parallel-sampling request into one output, and tracks per-request metrics.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvflow.core.sched.output import EngineCoreEventType
from kvflow.engine.stats import FinishedRequestStats, IterationStats
from kvflow.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
)
from kvflow.utils import child_request_id

if TYPE_CHECKING:
    from kvflow.core.sched.output import EngineCoreEvent, EngineCoreOutput, LogprobsLists
    from kvflow.engine.detokenizer import IncrementalDetokenizer
    from kvflow.engine.input_processor import ProcessedPrompt
    from kvflow.lora.request import LoRARequest
    from kvflow.request import Request
    from kvflow.sampling_params import SamplingParams
    from kvflow.tokenizer import Tokenizer
    from kvflow.tracing import RequestTracer


# The RequestMetrics field each timed core event sets (its first occurrence).
_EVENT_METRICS = {
    EngineCoreEventType.QUEUED: "queued_time",
    EngineCoreEventType.SCHEDULED: "first_scheduled_time",
}


@dataclass
class ParentRequest:
    """A user request with `n` > 1 samples: child `i` runs in the core as its own request.

    Invariant: `completions[i]` is child `i`'s latest cumulative completion (None before its first output);
    the parent is finished exactly when every child is. `prompt_logprobs` is child 0's, once complete (only child 0
    computes them); `prompt_logprobs_emitted` says a delta output already carried them.
    """

    request_id: str
    n: int
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: str
    metrics: RequestMetrics
    completions: list[CompletionOutput | None] = field(default_factory=list)
    arrival_monotonic: float = 0.0  # the time.monotonic() stamp behind metrics.arrival_time
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_emitted: bool = False
    lora_request: LoRARequest | None = None

    def __post_init__(self) -> None:
        self.completions = [None] * self.n

    @property
    def finished(self) -> bool:
        return all(
            completion is not None and completion.finished for completion in self.completions
        )


@dataclass
class RequestState:
    """Client-side state of one core request: what it produced, what was emitted, and its metrics.

    `prompt_logprobs` (None unless the request asked) starts as `[None]` (prompt token 0) and grows by the rows the
    core sends; it is complete when it has one entry per prompt token, and only then shown
    (`complete_prompt_logprobs`). `prompt_logprobs_emitted` says a delta output already carried them.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    metrics: RequestMetrics
    detokenizer: IncrementalDetokenizer | None = None
    tokenizer: Tokenizer | None = None
    parent: ParentRequest | None = None
    index: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    num_emitted_tokens: int = 0  # for output_kind="delta"
    num_emitted_logprobs: int = 0
    weight_versions: list[int] = field(default_factory=list)
    arrival_monotonic: float = 0.0  # the time.monotonic() stamp behind metrics.arrival_time
    last_token_monotonic: float | None = None  # when the latest output token reached the front end
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_emitted: bool = False
    # Finished with "error" through its own fault (EngineCoreOutput.client_error).
    client_error: bool = False
    lora_request: LoRARequest | None = None
    # A pooling request (it generates nothing): its result once the core sent it.
    is_pooling: bool = False
    pooled: np.ndarray | None = None
    # The W3C trace context (traceparent / tracestate) its span joins, when traced (kvflow.tracing).
    trace_headers: Mapping[str, str] | None = None

    def stamp(self, now_monotonic: float) -> float:
        """The wall-clock time of a `time.monotonic()` stamp, measured from this request's arrival."""
        return self.metrics.arrival_time + (now_monotonic - self.arrival_monotonic)

    @property
    def complete_prompt_logprobs(self) -> PromptLogprobs | None:
        """The prompt logprobs once there is one entry per prompt token; None before (or when not asked)."""
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None or len(prompt_logprobs) < len(self.prompt_token_ids):
            return None
        return prompt_logprobs


@dataclass
class OutputProcessorOutput:
    """One step's user-visible outputs, the core requests a stop string ended (to abort in the core), and what the
    step added to the stats."""

    request_outputs: list[RequestOutput] = field(default_factory=list)
    reqs_to_abort: list[str] = field(default_factory=list)
    iteration_stats: IterationStats = field(default_factory=IterationStats)


class OutputProcessor:
    """Accumulates each request's tokens and text and builds `RequestOutput`s per its `output_kind`.

    Invariants: a core request is tracked from `add_request` until its finished output (or `abort_requests`);
    the finished output is produced exactly once; text never shows a partial stop string while running.
    """

    def __init__(
        self, tokenizer: Tokenizer | None = None, tracer: RequestTracer | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.tracer = tracer  # ends a span per finished request (otlp_traces_endpoint)
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}

    # ------------------------------------------------------------------------------------------------ add
    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        parent: ParentRequest | None = None,
        index: int = 0,
        lora_request: LoRARequest | None = None,
        is_pooling: bool = False,
        trace_headers: Mapping[str, str] | None = None,
    ) -> None:
        if request_id in self.request_states:
            raise ValueError(f"request id {request_id!r} is already in use")
        if parent is not None:
            # The samples share their parent's clock reading, so their stamps compare exactly with its own.
            arrival_monotonic = parent.arrival_monotonic
            metrics = RequestMetrics(arrival_time=parent.metrics.arrival_time)
        else:
            arrival_monotonic = arrival_time if arrival_time is not None else time.monotonic()
            metrics = _arrival_metrics(arrival_monotonic)
        detokenizer = None
        if self.tokenizer is not None and not is_pooling:
            from kvflow.engine.detokenizer import IncrementalDetokenizer

            detokenizer = IncrementalDetokenizer(
                self.tokenizer, list(prompt_token_ids), sampling_params
            )
        state = RequestState(
            request_id,
            prompt,
            list(prompt_token_ids),
            sampling_params,
            metrics,
            detokenizer,
            self.tokenizer,
            parent,
            index,
            arrival_monotonic=arrival_monotonic,
            lora_request=lora_request,
            is_pooling=is_pooling,
            trace_headers=trace_headers,
        )
        if sampling_params.logprobs is not None:
            state.logprobs = []
        if sampling_params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        self.request_states[request_id] = state

    def add_parent_request(
        self,
        request_id: str,
        n: int,
        prompt: str | None,
        prompt_token_ids: list[int],
        output_kind: str,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> ParentRequest:
        """Register a parallel-sampling request; its children are added with `add_request(..., parent=...)`."""
        if request_id in self.parent_requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival_monotonic = arrival_time if arrival_time is not None else time.monotonic()
        parent = ParentRequest(
            request_id,
            n,
            prompt,
            list(prompt_token_ids),
            output_kind,
            _arrival_metrics(arrival_monotonic),
            arrival_monotonic=arrival_monotonic,
            lora_request=lora_request,
        )
        self.parent_requests[request_id] = parent
        return parent

    def add_prompt(
        self,
        request_id: str,
        processed: ProcessedPrompt,
        requests: list[Request],
        trace_headers: Mapping[str, str] | None = None,
    ) -> None:
        """Track one prompt's core requests (from `InputProcessor.make_requests`): the request itself, or a
        parent `request_id` that folds its `n` children's outputs into one. `trace_headers`: the trace context
        their spans join."""
        parent = None
        if len(requests) > 1:
            parent = self.add_parent_request(
                request_id,
                len(requests),
                processed.prompt,
                processed.prompt_token_ids,
                processed.sampling_params.output_kind,
                requests[0].arrival_time,
                requests[0].lora_request,
            )
        for index, request in enumerate(requests):
            self.add_request(
                request.request_id,
                processed.prompt,
                processed.prompt_token_ids,
                request.sampling_params,
                request.arrival_time,
                parent=parent,
                index=index,
                lora_request=request.lora_request,
                is_pooling=request.pooling_params is not None,
                trace_headers=trace_headers,
            )

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    # ------------------------------------------------------------------------------------------------ step
    def process_outputs(
        self, engine_core_outputs: list[EngineCoreOutput], finished_only: bool = False
    ) -> OutputProcessorOutput:
        """Apply one step's outputs; returns the RequestOutputs to deliver and the core requests to abort.

        `finished_only` (a caller that only wants final results, like `LLM.generate`) builds no output for an
        unfinished request, so a step costs O(new tokens), not a copy of every request's cumulative tokens and text.
        """
        now = time.monotonic()
        result = OutputProcessorOutput()
        request_outputs, reqs_to_abort = result.request_outputs, result.reqs_to_abort
        for engine_output in engine_core_outputs:
            state = self.request_states.get(engine_output.request_id)
            if state is None:
                continue  # aborted on this side already
            if engine_output.new_token_ids:
                _count_tokens(result.iteration_stats, state, len(engine_output.new_token_ids), now)
            elif engine_output.pooling_output is not None:
                state.pooled = engine_output.pooling_output.to_array()
                result.iteration_stats.num_prompt_tokens += len(state.prompt_token_ids)
            finish_reason, stop_reason = self._apply(state, engine_output, now)
            if finish_reason is not None and engine_output.finish_reason is None:
                # A stop string ended it; the core does not know yet.
                reqs_to_abort.append(state.request_id)
            finished = finish_reason is not None and not engine_output.session_continues
            if finished:
                self._finish(state, finish_reason, now, result.iteration_stats)
            elif finished_only:
                continue
            request_output = self._make_output(state, finish_reason, stop_reason, finished)
            if request_output is not None:
                request_outputs.append(request_output)
        return result

    def _apply(
        self, state: RequestState, engine_output: EngineCoreOutput, now: float
    ) -> tuple[str | None, int | str | None]:
        """Append tokens, logprobs and text; returns the (finish_reason, stop_reason) after this output."""
        new_token_ids = engine_output.new_token_ids
        if engine_output.events:
            self._apply_events(state, engine_output.events)
        if new_token_ids:
            self._stamp_token_times(state, now)
        state.output_token_ids.extend(new_token_ids)
        if new_token_ids and (
            not state.weight_versions or state.weight_versions[-1] != engine_output.weight_version
        ):
            state.weight_versions.append(engine_output.weight_version)
        state.metrics.num_cached_tokens = engine_output.num_cached_tokens
        if state.logprobs is not None and engine_output.new_logprobs is not None:
            self._append_logprobs(state, engine_output.new_logprobs)
        if state.prompt_logprobs is not None and engine_output.new_prompt_logprobs is not None:
            self._append_prompt_logprobs(state, engine_output.new_prompt_logprobs)
        finish_reason, stop_reason = engine_output.finish_reason, engine_output.stop_reason
        state.client_error = engine_output.client_error
        if state.detokenizer is not None:
            stop_string = state.detokenizer.update(new_token_ids, finish_reason == "stop")
            if stop_string is not None:
                finish_reason, stop_reason = "stop", stop_string
        return finish_reason, stop_reason

    @staticmethod
    def _stamp_token_times(state: RequestState, now: float) -> None:
        """New tokens arrived: the first sets `first_token_time`; every one moves `last_token_time` (parent too)."""
        metrics = state.metrics
        metrics.last_token_time = state.stamp(now)
        if metrics.first_token_time is None:
            metrics.first_token_time = metrics.last_token_time
        if state.parent is not None:
            parent_metrics = state.parent.metrics
            parent_metrics.last_token_time = max(
                parent_metrics.last_token_time or 0.0, metrics.last_token_time
            )

    @staticmethod
    def _apply_events(state: RequestState, events: list[EngineCoreEvent]) -> None:
        """Turn the core's lifecycle events into metrics: the first queued / scheduled stamps, and preemptions.

        A parallel-sampling parent keeps its children's earliest stamps and the sum of their preemptions.
        """
        metrics = state.metrics
        parent_metrics = state.parent.metrics if state.parent is not None else None
        for event in events:
            if event.type == EngineCoreEventType.PREEMPTED:
                metrics.num_preemptions += 1
                if parent_metrics is not None:
                    parent_metrics.num_preemptions += 1
                continue
            name = _EVENT_METRICS[event.type]
            if getattr(metrics, name) is not None:
                continue  # a later queueing of the same request (a streaming chunk's, say)
            stamp = state.stamp(event.timestamp)
            setattr(metrics, name, stamp)
            if parent_metrics is not None:
                earliest = getattr(parent_metrics, name)
                setattr(parent_metrics, name, stamp if earliest is None else min(earliest, stamp))

    def _append_logprobs(self, state: RequestState, new_logprobs: LogprobsLists) -> None:
        assert state.logprobs is not None
        for token_ids, values, sampled_rank in zip(
            new_logprobs.logprob_token_ids,
            new_logprobs.logprobs,
            new_logprobs.sampled_token_ranks,
            strict=True,
        ):
            state.cumulative_logprob += values[0]
            state.logprobs.append(self._position_logprobs(token_ids, values, sampled_rank))

    def _append_prompt_logprobs(self, state: RequestState, rows: LogprobsLists) -> None:
        """Add the core's prompt-logprob rows (they continue the entries so far: row j is entry start_index + j)."""
        prompt_logprobs = state.prompt_logprobs
        assert prompt_logprobs is not None
        assert rows.start_index == len(prompt_logprobs), (
            f"prompt logprobs of {state.request_id!r}: rows start at token {rows.start_index}, "
            f"expected {len(prompt_logprobs)}"
        )
        for token_ids, values, rank in zip(
            rows.logprob_token_ids, rows.logprobs, rows.sampled_token_ranks, strict=True
        ):
            prompt_logprobs.append(self._position_logprobs(token_ids, values, rank))

    def _position_logprobs(
        self, token_ids: list[int], values: list[float], token_rank: int
    ) -> dict[int, Logprob]:
        """One position's `{token id: Logprob}`: the actual (sampled or prompt) token first with `token_rank`, then
        the top tokens with ranks 1, 2, ... (a top token that is the actual one keeps its first entry)."""
        position: dict[int, Logprob] = {}
        for i, (token_id, value) in enumerate(zip(token_ids, values, strict=True)):
            rank = token_rank if i == 0 else i
            position.setdefault(token_id, Logprob(value, rank, self._decode_token(token_id)))
        return position

    def _decode_token(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        from kvflow.engine.detokenizer import decode_token

        return decode_token(self.tokenizer, token_id)

    def _finish(
        self, state: RequestState, finish_reason: str | None, now: float, stats: IterationStats
    ) -> None:
        """Stamp, forget, count and trace a request that finished."""
        metrics = state.metrics
        metrics.finished_time = state.stamp(now)
        del self.request_states[state.request_id]
        stats.finished_requests.append(
            FinishedRequestStats(
                finish_reason=finish_reason,
                e2e_latency=metrics.finished_time - metrics.arrival_time,
                time_to_first_token=_duration(metrics.arrival_time, metrics.first_token_time),
                num_prompt_tokens=len(state.prompt_token_ids),
                num_generation_tokens=len(state.output_token_ids),
                num_cached_tokens=metrics.num_cached_tokens,
                queue_time=_duration(metrics.queued_time, metrics.first_scheduled_time),
                prefill_time=_duration(metrics.first_scheduled_time, metrics.first_token_time),
                decode_time=_duration(metrics.first_token_time, metrics.last_token_time),
                inference_time=_duration(metrics.first_scheduled_time, metrics.last_token_time),
                num_preemptions=metrics.num_preemptions,
            )
        )
        if self.tracer is not None:
            self.tracer.request_finished(state, stats.finished_requests[-1])

    # ------------------------------------------------------------------------------------------------ abort
    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        """Finish requests (user-facing ids, parents included) with finish_reason "abort"; returns their final
        outputs with the partial tokens kept."""
        outputs = []
        for request_id in request_ids:
            for core_request_id in self.core_request_ids(request_id):
                state = self.request_states.pop(core_request_id, None)
                if state is None:
                    continue
                state.metrics.finished_time = state.stamp(time.monotonic())
                output = self._make_output(state, "abort", None, finished=True)
                if output is not None:
                    outputs.append(output)
        return outputs

    def core_request_ids(self, request_id: str) -> list[str]:
        """The core requests behind a user-facing id: itself, or a parallel-sampling request's children."""
        parent = self.parent_requests.get(request_id)
        if parent is None:
            return [request_id]
        return [child_request_id(parent.request_id, index) for index in range(parent.n)]

    # ------------------------------------------------------------------------------------------------ build
    def _make_output(
        self,
        state: RequestState,
        finish_reason: str | None,
        stop_reason: int | str | None,
        finished: bool,
    ) -> RequestOutput | PoolingRequestOutput | None:
        if state.pooled is not None:
            return PoolingRequestOutput(
                request_id=state.request_id,
                outputs=PoolingOutput(torch.from_numpy(state.pooled.copy())),
                prompt_token_ids=state.prompt_token_ids,
                finished=finished,
                prompt=state.prompt,
                num_cached_tokens=state.metrics.num_cached_tokens,
                metrics=state.metrics,
            )
        completion = self._make_completion(
            state, finish_reason if finished else None, stop_reason if finished else None, finished
        )
        if state.parent is not None:
            return self._make_parent_output(state.parent, state, completion)
        if completion is None:
            return None
        prompt_logprobs = state.complete_prompt_logprobs
        if prompt_logprobs is not None and state.sampling_params.output_kind == "delta":
            prompt_logprobs = None if state.prompt_logprobs_emitted else prompt_logprobs
            state.prompt_logprobs_emitted = True
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            metrics=state.metrics,
            prompt_logprobs=prompt_logprobs,
            lora_request=state.lora_request,
        )

    @staticmethod
    def _make_completion(
        state: RequestState,
        finish_reason: str | None,
        stop_reason: int | str | None,
        finished: bool,
    ) -> CompletionOutput | None:
        output_kind = state.sampling_params.output_kind
        if output_kind == "final_only" and not finished and state.parent is None:
            return None
        delta = output_kind == "delta"
        text = (
            state.detokenizer.get_next_output_text(finished, delta)
            if state.detokenizer is not None
            else ""
        )
        if delta:
            token_ids = state.output_token_ids[state.num_emitted_tokens :]
            state.num_emitted_tokens = len(state.output_token_ids)
            logprobs = None
            if state.logprobs is not None:
                logprobs = state.logprobs[state.num_emitted_logprobs :]
                state.num_emitted_logprobs = len(state.logprobs)
        else:
            token_ids = list(state.output_token_ids)
            logprobs = list(state.logprobs) if state.logprobs is not None else None
        return CompletionOutput(
            index=state.index,
            text=text,
            token_ids=token_ids,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            logprobs=logprobs,
            cumulative_logprob=state.cumulative_logprob if state.logprobs is not None else None,
            weight_versions=list(state.weight_versions),
            client_error=state.client_error,
        )

    def _make_parent_output(
        self, parent: ParentRequest, state: RequestState, completion: CompletionOutput | None
    ) -> RequestOutput | None:
        """Fold a child's completion into its parent: delta streams only that child's news; cumulative shows
        every child's progress; final_only waits for the last child."""
        assert completion is not None
        parent.completions[state.index] = completion
        if parent.prompt_logprobs is None:
            # Child 0's: only it computes them (the others have prompt_logprobs None and return None here).
            parent.prompt_logprobs = state.complete_prompt_logprobs
        parent.metrics.num_cached_tokens = max(
            parent.metrics.num_cached_tokens, state.metrics.num_cached_tokens
        )
        if state.metrics.first_token_time is not None and parent.metrics.first_token_time is None:
            parent.metrics.first_token_time = state.metrics.first_token_time
        finished = parent.finished
        if finished:
            parent.metrics.finished_time = state.metrics.finished_time
            del self.parent_requests[parent.request_id]
        if parent.output_kind == "final_only" and not finished:
            return None
        outputs = (
            [completion]
            if parent.output_kind == "delta"
            else [c for c in parent.completions if c is not None]
        )
        prompt_logprobs = parent.prompt_logprobs
        if prompt_logprobs is not None and parent.output_kind == "delta":
            prompt_logprobs = None if parent.prompt_logprobs_emitted else prompt_logprobs
            parent.prompt_logprobs_emitted = True
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            metrics=parent.metrics,
            prompt_logprobs=prompt_logprobs,
            lora_request=parent.lora_request,
        )


def _duration(start: float | None, end: float | None) -> float | None:
    """`end - start`, or None when either end is unknown."""
    return None if start is None or end is None else end - start


def _arrival_metrics(arrival_monotonic: float) -> RequestMetrics:
    """Fresh metrics whose `arrival_time` is the wall-clock time (`time.time()`) of a `time.monotonic()` arrival
    stamp; later stamps are `arrival_time` plus monotonic deltas (`RequestState.stamp`), so durations between them
    never see wall-clock jumps."""
    return RequestMetrics(arrival_time=time.time() - (time.monotonic() - arrival_monotonic))


def _count_tokens(
    stats: IterationStats, state: RequestState, num_new_tokens: int, now: float
) -> None:
    """Count a request's new tokens: its first output ends its prefill (time to first token); each token of a later
    output adds an inter-token latency (an output's tokens share the gap since the previous output)."""
    stats.num_generation_tokens += num_new_tokens
    if state.last_token_monotonic is None:
        stats.num_prompt_tokens += len(state.prompt_token_ids)
        stats.time_to_first_tokens.append(now - state.arrival_monotonic)
    else:
        gap = (now - state.last_token_monotonic) / num_new_tokens
        stats.inter_token_latencies.extend([gap] * num_new_tokens)
    state.last_token_monotonic = now
