"""LLM: the offline API. `LLM().generate("Hello", SamplingParams(max_tokens=32))`."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from kvflow.engine.arg_utils import EngineArgs
from kvflow.engine.builder import build_engine
from kvflow.engine.input_processor import ProcessedPrompt, PromptType, check_priority
from kvflow.engine.stat_logger import LoggingStatLogger
from kvflow.entrypoints.interrupts import DeferredInterrupt
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
        engine_args = EngineArgs(model=model, **kwargs)
        if engine_args.engine_process:
            raise ValueError(
                "engine_process=True is for AsyncLLM and `kvflow serve`, whose engine core runs in its own "
                "process; LLM steps its engine core itself, in this process"
            )
        if engine_args.data_parallel_size != 1:
            raise ValueError(
                f"data_parallel_size={engine_args.data_parallel_size}: LLM steps one engine core in this "
                "process; data parallelism (several engine cores behind one front end) is for AsyncLLM and "
                "`kvflow serve --data-parallel-size N`"
            )
        parts = build_engine(engine_args)
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
        self._stat_logger = None if engine_args.disable_log_stats else LoggingStatLogger()

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
        use_tqdm: bool | Callable[..., tqdm] = True,
        priority: int | Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one finished RequestOutput per prompt, in input order.

        A prompt is a string or `{"prompt_token_ids": [...]}` (or `{"prompt": "..."}`). `priority` (one int, or
        one per prompt; lower runs first) needs `scheduling_policy="priority"`. `use_tqdm` may be a tqdm-like
        factory. While the engine is paused the call waits (its requests are queued) and continues after
        `resume_generation`; a pause in mode "abort" finishes them with finish_reason "abort".

        Any exception or interrupt (Ctrl-C) that leaves the call aborts its requests, so their KV blocks and worker
        slots are freed and the LLM stays usable. In the main thread a Ctrl-C is held back until the running engine
        step is over, so it never interrupts a step half-way.
        """
        prompt_list = self.input_processor.normalize_prompts(prompts)
        params_list = self._expand_sampling_params(sampling_params, len(prompt_list))
        priorities = self._expand_priority(priority, len(prompt_list))
        processed = [
            self.input_processor.process(prompt, params)
            for prompt, params in zip(prompt_list, params_list, strict=True)
        ]
        request_ids: list[str] = []
        with DeferredInterrupt() as interrupt:
            try:
                with self._lock:
                    self._num_generating += 1
                    for item, item_priority in zip(processed, priorities, strict=True):
                        request_ids.append(self._add_request(item, item_priority))
                prompt_lens = {
                    request_id: len(item.prompt_token_ids)
                    for request_id, item in zip(request_ids, processed, strict=True)
                }
                finished = self._run_to_completion(prompt_lens, use_tqdm, interrupt)
            except BaseException:
                self._abandon(request_ids)
                raise
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

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Run a worker method (by name, or a callable taking the worker as its first argument) on every rank,
        between engine steps; returns the results in rank order (`EngineCore.collective_rpc`)."""
        with self._lock:
            return self.engine_core.collective_rpc(method, args, kwargs)

    def shutdown(self) -> None:
        """Stop the engine's workers (tensor-parallel worker processes or Ray actors); the LLM is unusable after.
        Idempotent; an LLM that is garbage-collected or outlives the interpreter stops them too."""
        with self._lock:
            self.engine_core.shutdown()

    # ------------------------------------------------------------------------------------------------ internals
    def _expand_sampling_params(
        self,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        num_prompts: int,
    ) -> list[SamplingParams]:
        return self.input_processor.expand_sampling_params(sampling_params, num_prompts)

    def _expand_priority(self, priority: int | Sequence[int] | None, num_prompts: int) -> list[int]:
        if priority is None:
            return [0] * num_prompts
        priorities = [priority] * num_prompts if isinstance(priority, int) else list(priority)
        if len(priorities) != num_prompts:
            raise ValueError(f"priority has {len(priorities)} entries for {num_prompts} prompts")
        policy = self.engine_config.scheduler_config.policy
        return [check_priority(value, policy) for value in priorities]

    def _add_request(self, processed: ProcessedPrompt, priority: int = 0) -> str:
        """Queue one prompt (n child requests when `n > 1`). Caller holds the lock."""
        request_id = str(next(self._request_counter))
        requests = self.input_processor.make_requests(
            request_id, processed, time.monotonic(), priority=priority
        )
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
        if self._stat_logger is not None:
            self._stat_logger.record(self.engine_core.make_stats(), processed.iteration_stats)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        for request_output in processed.request_outputs:
            if request_output.finished:
                self._finished[request_output.request_id] = request_output
        self._changed.notify_all()

    def _abandon(self, request_ids: list[str]) -> None:
        """Abort a failed or interrupted call's requests. When no other `generate` is stepping the engine, also
        step until the worker has heard of the aborts and nothing is in flight, so their slots are free too."""
        with self._lock:
            core_request_ids = [
                core_request_id
                for request_id in request_ids
                for core_request_id in self.output_processor.core_request_ids(request_id)
            ]
            self.engine_core.abort_requests(core_request_ids)
            self.output_processor.abort_requests(request_ids)
            for request_id in request_ids:
                self._finished.pop(request_id, None)
            if self._num_generating == 1:
                core = self.engine_core
                while core.batch_queue or core.scheduler.has_pending_reports():
                    self._step_locked()

    def _run_to_completion(
        self,
        prompt_lens: dict[str, int],
        use_tqdm: bool | Callable[..., tqdm],
        interrupt: DeferredInterrupt,
    ) -> dict[str, RequestOutput]:
        """Step (or wait while another thread steps) until every request of `prompt_lens` has finished."""
        pending = set(prompt_lens)
        finished: dict[str, RequestOutput] = {}
        progress = _Progress(
            use_tqdm,
            {
                core_request_id: (request_id, num_prompt_tokens)
                for request_id, num_prompt_tokens in prompt_lens.items()
                for core_request_id in self.output_processor.core_request_ids(request_id)
            },
        )
        while pending:
            with self._lock:
                if self.engine_core.can_make_progress():
                    progress.record_step(self._step_locked())
                elif self.engine_core.is_paused():
                    self._changed.wait(_PAUSED_POLL_S)  # held by a pause: wait for resume
                elif not any(request_id in self._finished for request_id in pending):
                    raise RuntimeError("engine went idle with requests unfinished")
                for request_id in [
                    request_id for request_id in self._finished if request_id in pending
                ]:
                    finished[request_id] = self._finished.pop(request_id)
                    pending.discard(request_id)
                    progress.record_finished()
            progress.refresh()
            interrupt.check()
        progress.close()
        return finished


class _Progress:
    """The progress bar of one `generate` call: finished requests, and input / output tokens per second, where a
    prompt's tokens count once its first output token arrives (it has been prefilled by then)."""

    def __init__(
        self, use_tqdm: bool | Callable[..., tqdm], prompt_of: dict[str, tuple[str, int]]
    ) -> None:
        """`prompt_of` maps each core request id to its user request id and prompt length."""
        make_bar = use_tqdm if callable(use_tqdm) else tqdm
        self.bar = make_bar(
            total=len({request_id for request_id, _ in prompt_of.values()}),
            desc="Processed prompts",
            unit="req",
            disable=use_tqdm is False,
            dynamic_ncols=True,
        )
        self._not_prefilled = dict(prompt_of)
        self._prefilled: set[str] = set()
        self._start = time.monotonic()
        self.num_input_tokens = 0
        self.num_output_tokens = 0

    def record_step(self, engine_outputs: list[EngineCoreOutput]) -> None:
        for output in engine_outputs:
            if not output.new_token_ids:
                continue
            self.num_output_tokens += len(output.new_token_ids)
            prompt = self._not_prefilled.pop(output.request_id, None)
            # The `n` samples of a prompt share it: count it once.
            if prompt is not None and prompt[0] not in self._prefilled:
                self._prefilled.add(prompt[0])
                self.num_input_tokens += prompt[1]

    def refresh(self) -> None:
        """Show the rates; called once per loop iteration of `generate`, outside the engine lock."""
        elapsed = max(time.monotonic() - self._start, 1e-9)
        self.bar.set_postfix_str(
            f"input {self.num_input_tokens / elapsed:.0f} tok/s, "
            f"output {self.num_output_tokens / elapsed:.0f} tok/s",
            refresh=False,
        )

    def record_finished(self) -> None:
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _check_conversation(conversation: object) -> None:
    """A conversation is a non-empty list; its messages are checked where every chat path renders them
    (`Tokenizer.apply_chat_template`)."""
    if not isinstance(conversation, list | tuple) or not conversation:
        raise ValueError("each conversation must be a non-empty list of {'role', 'content'} dicts")
