"""LLM: the offline API. `LLM().generate("Hello", SamplingParams(max_tokens=32))`."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from kvflow.engine.arg_utils import EngineArgs
from kvflow.engine.builder import build_engine
from kvflow.engine.input_processor import ProcessedPrompt, PromptType
from kvflow.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvflow.core.sched.output import EngineCoreOutput
    from kvflow.outputs import RequestOutput
    from kvflow.tokenizer import Tokenizer

ChatMessages = list[dict[str, Any]]
_PAUSED_POLL_S = 0.05


class LLM:
    """Offline batched generation on one engine.

    `model=None` is the built-in default model (created on first use, no download), a path is a Hugging Face
    checkpoint folder, `"hash"` the deterministic test model. Requests are validated whole before any is queued,
    so a bad prompt or parameter raises `ValueError` and leaves the engine untouched. Outputs come back in input
    order.

    Thread safety: one lock guards the engine; `generate` releases it between steps, so another thread may call
    `pause_generation`, `resume_generation`, `is_paused`, `reset_prefix_cache` or `update_weights` while a
    generation runs. Whichever thread steps the engine files finished outputs where their `generate` call finds
    them.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """`kwargs` are the `EngineArgs` options (unknown names are a TypeError, bad values a ValueError)."""
        parts = build_engine(EngineArgs(model=model, **kwargs))
        self.engine_config = parts.engine_config
        self.model_info = parts.model_info
        self.tokenizer = parts.tokenizer
        self.engine_core = parts.engine_core
        self.input_processor = parts.input_processor
        self.output_processor = parts.output_processor
        self.vocab_size = self.input_processor.vocab_size
        self.eos_token_id = self.input_processor.eos_token_id
        self._request_counter = itertools.count()
        self._lock = threading.RLock()
        # Notified after every step and every pause/resume.
        self._changed = threading.Condition(self._lock)
        self._finished: dict[str, RequestOutput] = {}
        self._num_generating = 0

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLM:
        return cls(**dataclasses.asdict(engine_args))

    # ------------------------------------------------------------------------------------------------ public
    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams of a `generate` call without any: kvflow's defaults overridden by the model's
        generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) unless
        `generation_config="kvflow"`. A fresh copy: change it and pass it on."""
        return self.input_processor.get_default_sampling_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one finished RequestOutput per prompt, in input order.

        A prompt is a string or `{"prompt_token_ids": [...]}` (or `{"prompt": "..."}`). While the engine is paused
        the call waits (its requests are queued) and continues after `resume_generation`; a pause in mode "abort"
        finishes them with finish_reason "abort".
        """
        prompt_list = self.input_processor.normalize_prompts(prompts)
        params_list = self._expand_sampling_params(sampling_params, len(prompt_list))
        processed = [
            self.input_processor.process(prompt, params)
            for prompt, params in zip(prompt_list, params_list, strict=True)
        ]
        with self._lock:
            request_ids = [self._add_request(item) for item in processed]
            self._num_generating += 1
        try:
            finished = self._run_to_completion(request_ids, use_tqdm)
        finally:
            with self._lock:
                self._num_generating -= 1
        return [finished[request_id] for request_id in request_ids]

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        **chat_template_kwargs: Any,
    ) -> list[RequestOutput]:
        """Render each conversation with the checkpoint's chat template (or `chat_template`) and generate.

        `messages` is one conversation (a list of `{"role", "content"}` dicts) or a list of them.
        """
        if self.tokenizer is None:
            raise ValueError(
                "chat() needs a tokenizer (this LLM has skip_tokenizer_init=True or no tokenizer)"
            )
        if not isinstance(messages, list | tuple) or not messages:
            raise ValueError(
                "messages must be a non-empty list of {'role', 'content'} dicts (or a list of them)"
            )
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts: list[PromptType] = []
        for conversation in conversations:
            _check_conversation(conversation)
            text = self.tokenizer.apply_chat_template(
                list(conversation),
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                **chat_template_kwargs,
            )
            prompts.append(
                {
                    "prompt": text,
                    "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False),
                }
            )
        return self.generate(prompts, sampling_params, use_tqdm)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Fraction of prompt tokens served from the prefix cache since the engine started."""
        return self.engine_core.scheduler.prefix_cache_stats.hit_rate

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        with self._lock:
            return self.engine_core.reset_prefix_cache(reset_running_requests)

    # ------------------------------------------------------------------------------------------------ pause
    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Pause (semantics: `kvflow.engine.core.Pause`). Returns once the pause has taken effect, or once a
        concurrent `resume_generation` released it."""
        with self._lock:
            self._apply(self.engine_core.pause_generation(mode, clear_cache))
            while self.engine_core.is_paused() and not self.engine_core.pause_effective():
                if self._num_generating:
                    self._changed.wait(_PAUSED_POLL_S)  # a generate() call is stepping the engine
                else:
                    self._step_locked()

    def resume_generation(self) -> None:
        with self._lock:
            self.engine_core.resume_generation()
            self._changed.notify_all()

    def is_paused(self) -> bool:
        with self._lock:
            return self.engine_core.is_paused()

    def update_weights(self, weights: Any) -> int:
        """Reload weights (a checkpoint folder or a state dict) between `pause_generation` and resume; returns the
        new weight version, which outputs record (`CompletionOutput.weight_versions`)."""
        with self._lock:
            return self.engine_core.update_weights(weights)

    # ------------------------------------------------------------------------------------------------ internals
    def _expand_sampling_params(
        self,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        num_prompts: int,
    ) -> list[SamplingParams]:
        return self.input_processor.expand_sampling_params(sampling_params, num_prompts)

    def _add_request(self, processed: ProcessedPrompt) -> str:
        """Queue one prompt (n child requests when `n > 1`). Caller holds the lock."""
        request_id = str(next(self._request_counter))
        requests = self.input_processor.make_requests(request_id, processed, time.monotonic())
        self.output_processor.add_prompt(request_id, processed, requests)
        try:
            self.engine_core.add_requests(requests)
        except ValueError:
            self.output_processor.abort_requests([request_id])
            raise
        return request_id

    def _step_locked(self) -> list[EngineCoreOutput]:
        """One engine step and its outputs filed; caller holds the lock."""
        engine_outputs = self.engine_core.step()
        self._apply(engine_outputs)
        return engine_outputs

    def _apply(self, engine_outputs: list[EngineCoreOutput]) -> None:
        processed = self.output_processor.process_outputs(engine_outputs, finished_only=True)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        for request_output in processed.request_outputs:
            if request_output.finished:
                self._finished[request_output.request_id] = request_output
        self._changed.notify_all()

    def _run_to_completion(
        self, request_ids: list[str], use_tqdm: bool
    ) -> dict[str, RequestOutput]:
        pending = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        progress = tqdm(
            total=len(request_ids),
            desc="Processed prompts",
            unit="req",
            disable=not use_tqdm,
            dynamic_ncols=True,
        )
        start, num_input_tokens, num_output_tokens = time.monotonic(), 0, 0
        while pending:
            with self._lock:
                if self.engine_core.can_make_progress():
                    num_output_tokens += sum(
                        len(output.new_token_ids) for output in self._step_locked()
                    )
                elif self.engine_core.is_paused():
                    self._changed.wait(_PAUSED_POLL_S)  # held by a pause: wait for resume
                elif not any(request_id in self._finished for request_id in pending):
                    raise RuntimeError("engine went idle with requests unfinished")
                for request_id in [
                    request_id for request_id in self._finished if request_id in pending
                ]:
                    finished[request_id] = output = self._finished.pop(request_id)
                    pending.discard(request_id)
                    num_input_tokens += len(output.prompt_token_ids)
                    progress.update(1)
            elapsed = max(time.monotonic() - start, 1e-9)
            progress.set_postfix_str(
                f"input {num_input_tokens / elapsed:.0f} tok/s, "
                f"output {num_output_tokens / elapsed:.0f} tok/s",
                refresh=False,
            )
        progress.close()
        return finished


def _check_conversation(conversation: object) -> None:
    if not isinstance(conversation, list | tuple) or not conversation:
        raise ValueError("each conversation must be a non-empty list of {'role', 'content'} dicts")
    for message in conversation:
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"each message must be a dict with a 'role', got {message!r}")
