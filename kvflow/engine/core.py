"""EngineCore: the scheduler and the executor, stepped together (synchronously or overlapped), plus pause/resume
and weight updates."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from kvflow.core.sched.async_scheduler import AsyncScheduler
from kvflow.core.sched.output import EngineCoreOutput
from kvflow.core.sched.scheduler import PauseState, Scheduler
from kvflow.engine.request_limits import RequestLimits
from kvflow.executor import get_executor_class, resolve_executor_backend
from kvflow.model_info import resolve_model_info
from kvflow.request import RequestStatus
from kvflow.structured_output.setup import make_structured_output_manager

if TYPE_CHECKING:
    from kvflow.config import EngineConfig
    from kvflow.core.sched.output import (
        GrammarOutput,
        ModelRunnerOutput,
        SchedulerOutput,
        SchedulerStats,
    )
    from kvflow.lora.request import LoRARequest
    from kvflow.model_info import ModelInfo
    from kvflow.request import Request

logger = logging.getLogger(__name__)

PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES = ("abort", "wait", "keep")


class EngineNotPausedError(RuntimeError):
    """A weight update was asked for while no pause is in effect (batches may be in flight)."""


# How long an idle engine waits for a compiling grammar before it looks at its inputs again.
_COMPILE_WAIT_S = 0.02


@dataclass
class InFlightBatch:
    """A launched step: its plan, the Future of its output, and the weight version that computes it.

    A step with structured-output requests is launched as a forward pass whose sampling waits for the step's
    `GrammarOutput` (`awaiting_grammar`); the engine sends it once every earlier batch has been applied, and
    `future` then becomes the sampling's (`forward_future` keeps the forward pass's, for its errors).
    """

    scheduler_output: SchedulerOutput
    future: Future[ModelRunnerOutput]
    weight_version: int
    awaiting_grammar: bool = False
    forward_future: Future[Any] | None = None

    def result(self) -> ModelRunnerOutput:
        assert not self.awaiting_grammar, "a batch's output was read before its grammar was sent"
        if self.forward_future is not None:
            self.forward_future.result()
        return self.future.result()


@dataclass
class Pause:
    """A pause the engine was asked for.

    Pause semantics (`EngineCore.pause_generation`, and through it `LLM`, `AsyncLLM` and the server):
      * "abort": every unfinished request ends now with finish_reason "abort", keeping its partial output;
      * "wait": started requests (running or preempted) run to completion; nothing new is admitted;
      * "keep": nothing is scheduled; requests keep their state and continue after resume.
    Requests added while paused are queued (counted, abortable) and run after `resume_generation`. A pause is
    `in_effect` once no batch is in flight and, for "wait", no started request is left; then, with `clear_cache`,
    `reset_prefix_cache(reset_running_requests=True)` runs once: running requests are preempted and recompute after
    resume. Pausing again while paused may change the mode; a pending `clear_cache` is never dropped.
    """

    mode: PauseMode
    clear_cache: bool
    in_effect: bool = False

    @property
    def scheduler_state(self) -> PauseState:
        """What the scheduler may run meanwhile: a pending "wait" lets started requests finish."""
        if self.mode == "wait" and not self.in_effect:
            return PauseState.PAUSED_NEW
        return PauseState.PAUSED_ALL


class EngineCore:
    """Owns one scheduler and one executor.

    `step()` runs schedule -> execute -> update_from_output. With `async_scheduling` it overlaps instead
    (`step_with_batch_queue`): step N+1 is scheduled and step N-1's output processed while the worker runs step N.

    Invariants:
      * a step runs whenever there is work, a batch in flight, or the worker still has to hear about finished or
        preempted requests, so every slot release reaches the worker before any admission that relies on it;
      * at most `batch_queue_size` batches are in flight (1: synchronous), and their outputs are applied in order;
      * the scheduler's `pause_state` is always `pause.scheduler_state` (UNPAUSED without a pause); a pause is in
        effect only when no batch is in flight (see `Pause` for the semantics), so no placeholder can be lost;
      * the weight version only changes while no batch is in flight; every output carries the version that
        computed its tokens;
      * structured outputs: a step's grammar bitmask is computed only after every earlier step's output has been
        applied (its forward pass runs meanwhile), so each matcher stands exactly after its request's kept tokens
        (see `StructuredOutputManager`); a grammar that fails to compile ends its request with "error".
    """

    def __init__(self, engine_config: EngineConfig, model_info: ModelInfo | None = None) -> None:
        self.engine_config = engine_config
        if model_info is None:
            model_info = resolve_model_info(engine_config.model_config.model)
        self.request_limits = RequestLimits.of(
            model_info, engine_config.model_config, engine_config.scheduler_config.max_model_len
        )
        self.structured_output_manager, self.no_structured_outputs_reason = (
            make_structured_output_manager(engine_config, model_info)
        )
        executor_class = get_executor_class(resolve_executor_backend(engine_config.parallel_config))
        self.executor = executor_class(engine_config, model_info)
        scheduler_config = engine_config.scheduler_config
        scheduler_cls = AsyncScheduler if scheduler_config.async_scheduling else Scheduler
        spec_config = getattr(engine_config, "speculative_config", None)
        try:
            self.scheduler = scheduler_cls(
                scheduler_config,
                engine_config.cache_config,
                num_kv_blocks=self.executor.num_kv_blocks,
                has_structured_outputs=self.structured_output_manager is not None,
                num_speculative_tokens=0
                if spec_config is None
                else spec_config.num_speculative_tokens,
                num_lookahead_tokens=spec_config.num_speculative_tokens
                if spec_config is not None and spec_config.method == "draft_model"
                else 0,
                # The model's KV cache groups (every rank has the same): sliding-window layers hold their window.
                max_loras=0
                if engine_config.lora_config is None
                else engine_config.lora_config.max_loras,
                kv_cache_group_windows=tuple(
                    self.executor.collective_rpc("kv_cache_group_windows")[0]
                ),
            )
        except BaseException:
            self.executor.shutdown()  # no worker process outlives a core that failed to start
            raise
        self.batch_queue_size = 2 if scheduler_config.async_scheduling else 1
        self.batch_queue: deque[InFlightBatch] = deque()
        self.weight_version = 0
        self.pause: Pause | None = None

    # ------------------------------------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        """Queue a request (or a streaming session's next chunk) once it passes `request_limits`; ValueError if
        it or the scheduler rejects it."""
        self.request_limits.check_request(request)
        if request.lora_request is not None and self.engine_config.lora_config is None:
            raise ValueError(
                f"lora_request {request.lora_request.lora_name!r}: LoRA is not enabled (enable_lora=True, "
                "--enable-lora)"
            )
        structured_outputs = request.sampling_params.structured_outputs
        if structured_outputs is not None and self.structured_output_manager is None:
            raise ValueError(
                f"SamplingParams.structured_outputs: {self.no_structured_outputs_reason}"
            )
        is_new = request.request_id not in self.scheduler.requests
        self.scheduler.add_request(request)
        if structured_outputs is not None and is_new:
            assert self.structured_output_manager is not None
            self.structured_output_manager.grammar_init(request)

    def add_requests(self, requests: list[Request]) -> None:
        """Queue a prompt's requests (its `n` samples) all or nothing: if one is rejected (any exception, a
        ValueError naming its field for anything a request can get wrong), the ones queued before it are
        aborted and the error is raised, so a bad request fails alone."""
        added: list[str] = []
        try:
            for request in requests:
                self.add_request(request)
                added.append(request.request_id)
        except Exception:
            self.abort_requests(added)
            raise

    def add_request_groups(self, groups: list[list[Request]]) -> None:
        """Queue several prompts' requests at once (`add_requests` for each group, in order): the step after this
        call sees all of them. A refused group raises, with the groups before it queued (the caller aborts them)."""
        for group in groups:
            self.add_requests(group)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finish requests with "abort", freeing their blocks and slots (unknown or finished ids are ignored)."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def close_session(self, request_id: str) -> bool:
        """End a streaming-input session after its current chunk. True when it ended now (it idled between chunks,
        or is already gone): no output will report it. False: the output that ends the running chunk ends it."""
        return self.scheduler.close_session(request_id)

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    # ------------------------------------------------------------------------------------------------ LoRA
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter into every rank's adapter cache now (a request naming it later loads it on its own
        when it is not cached); ValueError for a bad adapter (its folder, a module kvflow cannot apply, a rank
        above `max_lora_rank`) or when LoRA is off. True once every rank holds it."""
        self._check_lora_enabled("add_lora")
        return all(self.executor.collective_rpc("add_lora", (lora_request,), {}))

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter from the ranks' caches; requests that still run with it load it again from its path
        (none is lost). True when a rank held it."""
        self._check_lora_enabled("remove_lora")
        return any(self.executor.collective_rpc("remove_lora", (lora_int_id,), {}))

    def pin_lora(self, lora_int_id: int) -> bool:
        """Keep a loaded adapter in the caches (never evicted); False when no rank holds it."""
        self._check_lora_enabled("pin_lora")
        return all(self.executor.collective_rpc("pin_lora", (lora_int_id,), {}))

    def list_loras(self) -> set[int]:
        """The ids of the adapters every rank holds loaded."""
        self._check_lora_enabled("list_loras")
        return set.intersection(*self.executor.collective_rpc("list_loras", (), {}))

    def _check_lora_enabled(self, what: str) -> None:
        if self.engine_config.lora_config is None:
            raise ValueError(f"{what}: LoRA is not enabled (enable_lora=True, --enable-lora)")

    def has_work(self) -> bool:
        """Anything left at all: requests (also those a pause holds), a batch in flight, or unsent reports."""
        return (
            bool(self.batch_queue)
            or self.scheduler.has_unfinished_requests()
            or self.scheduler.has_pending_reports()
        )

    def has_in_flight(self) -> bool:
        """A batch in flight, or reports (finished or preempted requests) the worker has not heard of yet: while
        True, some worker slot may still be held by a request the scheduler already let go."""
        return bool(self.batch_queue) or self.scheduler.has_pending_reports()

    def can_make_progress(self) -> bool:
        """True when `step()` would do something: False when the only work left is held by a pause (or there is
        none), so a caller should wait for input instead of spinning."""
        pause_pending = self.pause is not None and not self.pause.in_effect
        return bool(self.batch_queue) or pause_pending or self._has_schedulable_work()

    # ------------------------------------------------------------------------------------------------ stepping
    def step(self) -> list[EngineCoreOutput]:
        """Run one engine step; returns the per-request outputs it produced (empty when idle)."""
        failed = self._poll_grammars()
        if self.batch_queue_size > 1:
            return failed + self.step_with_batch_queue()
        if not self._has_schedulable_work():
            return failed + self._settle_pause()
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.total_num_scheduled_tokens:
            self._wait_for_compile()
        model_runner_output = self.executor.execute_model(scheduler_output)
        if scheduler_output.has_structured_output_requests:  # that was the forward pass only
            model_runner_output = self.executor.sample_tokens(
                self._grammar_output(scheduler_output)
            )
        outputs = self._update(scheduler_output, model_runner_output, self.weight_version)
        return failed + outputs + self._settle_pause()

    def step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """Overlapped step: launch the next batch if the queue has room, and apply the oldest batch's output once
        the queue is full or nothing new could be launched. The worker feeds each request's last sampled token into
        its next step itself, so step N+1 can be planned before step N's tokens are back."""
        launched = False
        if len(self.batch_queue) < self.batch_queue_size and self._has_schedulable_work():
            launched = self._launch_batch()
        # While a pause is in effect only token-less report batches go out: apply them at once, so that no batch is
        # ever in flight while paused (update_weights and a repeated pause rely on it).
        queue_has_room = len(self.batch_queue) < self.batch_queue_size
        if not self.batch_queue or (launched and queue_has_room and not self.pause_effective()):
            if not launched:
                self._wait_for_compile()
            return self._settle_pause()
        outputs = self._apply_oldest_batch()
        return outputs + self._settle_pause()

    def _apply_oldest_batch(self) -> list[EngineCoreOutput]:
        """Apply the oldest in-flight batch's output; then the next batch, now the oldest, gets its bitmask."""
        batch = self.batch_queue.popleft()
        outputs = self._update(batch.scheduler_output, batch.result(), batch.weight_version)
        self._send_grammar_if_due()
        return outputs

    def _send_grammar_if_due(self) -> None:
        """Send the oldest batch its bitmask if it waits for one: every batch before it is applied, so the
        matchers stand after exactly the tokens their requests keep."""
        if not self.batch_queue or not self.batch_queue[0].awaiting_grammar:
            return
        batch = self.batch_queue[0]
        batch.forward_future = batch.future
        batch.future = self.executor.sample_tokens(
            self._grammar_output(batch.scheduler_output), non_block=True
        )
        batch.awaiting_grammar = False

    def _grammar_output(self, scheduler_output: SchedulerOutput) -> GrammarOutput:
        assert self.structured_output_manager is not None
        return self.structured_output_manager.grammar_bitmask(
            self.scheduler.requests, scheduler_output
        )

    def _poll_grammars(self) -> list[EngineCoreOutput]:
        """Admit requests whose grammar compiled; finish those whose grammar failed, with "error"."""
        manager = self.structured_output_manager
        if manager is None or not manager.has_compiling():
            return []
        outputs: list[EngineCoreOutput] = []
        for request, message in manager.poll():
            self.scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ERROR)
            outputs.append(
                EngineCoreOutput(
                    request.request_id,
                    [],
                    finish_reason="error",
                    stop_reason=f"structured outputs: {message}",
                    weight_version=self.weight_version,
                    client_error=True,
                )
            )
        return outputs

    def _wait_for_compile(self) -> None:
        """Nothing could be scheduled: if grammars are compiling, wait a moment for one instead of spinning."""
        manager = self.structured_output_manager
        if manager is not None and manager.has_compiling():
            manager.wait_for_compile(_COMPILE_WAIT_S)

    def _launch_batch(self) -> bool:
        """Schedule a step and hand it to the executor; False (nothing sent) when it carries nothing."""
        prev_step_scheduled_req_ids = self.scheduler.prev_step_scheduled_req_ids
        scheduler_output = self.scheduler.schedule()
        if not (
            scheduler_output.total_num_scheduled_tokens
            or scheduler_output.finished_req_ids
            or scheduler_output.preempted_req_ids
        ):
            # Never sent: the worker's previous step is still the last one launched.
            self.scheduler.prev_step_scheduled_req_ids = prev_step_scheduled_req_ids
            return False
        future = self.executor.execute_model(scheduler_output, non_block=True)
        self.batch_queue.append(
            InFlightBatch(
                scheduler_output,
                future,
                self.weight_version,
                awaiting_grammar=scheduler_output.has_structured_output_requests,
            )
        )
        self._send_grammar_if_due()
        return True

    def _has_schedulable_work(self) -> bool:
        """Something `schedule()` would send: reports, or requests the pause state lets run."""
        if self.scheduler.has_pending_reports():
            return True
        pause_state = self.scheduler.pause_state
        if pause_state == PauseState.PAUSED_ALL:
            return False
        if pause_state == PauseState.PAUSED_NEW:
            return self.scheduler.get_num_started_requests() > 0
        return self.scheduler.has_unfinished_requests()

    def _update(
        self,
        scheduler_output: SchedulerOutput,
        model_runner_output: ModelRunnerOutput,
        weight_version: int,
    ) -> list[EngineCoreOutput]:
        outputs = self.scheduler.update_from_output(scheduler_output, model_runner_output)
        for output in outputs:
            output.weight_version = weight_version
        return outputs

    # ------------------------------------------------------------------------------------------------ pause
    def pause_generation(
        self, mode: str = "abort", clear_cache: bool = True
    ) -> list[EngineCoreOutput]:
        """Ask for a pause (semantics: `Pause`). Returns the "abort" outputs of mode "abort". The pause is in
        effect at once if nothing is in flight; otherwise drive `step()` until `pause_effective()`."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        outputs = self._abort_all() if mode == "abort" else []
        pending_clear = (
            self.pause is not None and not self.pause.in_effect and self.pause.clear_cache
        )
        self._set_pause(Pause(mode, clear_cache or pending_clear))  # type: ignore[arg-type]
        return outputs + self._settle_pause()

    def _abort_all(self) -> list[EngineCoreOutput]:
        request_ids = [
            request_id
            for request_id, request in self.scheduler.requests.items()
            if not request.is_finished()
        ]
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        return [
            EngineCoreOutput(
                request_id, [], finish_reason="abort", weight_version=self.weight_version
            )
            for request_id in request_ids
        ]

    def pause_effective(self) -> bool:
        """True once a requested pause has fully taken effect (False when not paused)."""
        return self.pause is not None and self.pause.in_effect

    def is_paused(self) -> bool:
        return self.pause is not None

    def _settle_pause(self) -> list[EngineCoreOutput]:
        """Put a pending pause into effect once nothing is in flight (and, for "wait", no started request is
        left), running its cache reset exactly then."""
        pause = self.pause
        if pause is None or pause.in_effect or self.batch_queue:
            return []
        if pause.mode == "wait" and self.scheduler.get_num_started_requests() > 0:
            return []
        if pause.clear_cache:
            self.scheduler.reset_prefix_cache(reset_running_requests=True)
        pause.in_effect = True
        self._set_pause(pause)
        return []

    def resume_generation(self) -> None:
        """End the pause: held and frozen requests are scheduled again (preempted ones recompute)."""
        self._set_pause(None)

    def _set_pause(self, pause: Pause | None) -> None:
        self.pause = pause
        self.scheduler.set_pause_state(
            PauseState.UNPAUSED if pause is None else pause.scheduler_state
        )

    # ------------------------------------------------------------------------------------------------ cache, weights
    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget cached prefixes; `reset_running_requests` preempts every running request first. Batches may be
        in flight: the scheduler discards exactly their stale placeholders of the preempted requests."""
        return self.scheduler.reset_prefix_cache(reset_running_requests)

    def drain(self) -> list[EngineCoreOutput]:
        """Apply every in-flight batch's output (nothing new is launched)."""
        outputs: list[EngineCoreOutput] = []
        while self.batch_queue:
            outputs += self._apply_oldest_batch()
        return outputs

    def update_weights(self, weights: str | Any) -> int:
        """Load new weights (a checkpoint folder or a state dict of Hugging Face names) into the running model;
        returns the new weight version. Only while a pause is in effect, so nothing is in flight (the RLHF loop:
        pause -> update_weights -> resume)."""
        self._check_paused_for("update_weights")
        assert not self.batch_queue
        self.executor.update_weights(weights)
        self.weight_version += 1
        logger.info("weights updated: version %d", self.weight_version)
        return self.weight_version

    # ------------------------------------------------------------------------------------------------ workers
    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Run a worker method on every rank and return the results in rank order.

        `method` is the name of a `Worker` method, or a callable taking the worker as its first argument; it is
        called with `*args, **kwargs`. Runs between engine steps (a front end sends it as a utility call), so it
        never sees a step half-way; a step still in flight on the worker thread finishes first.
        """
        if not isinstance(method, str) and not callable(method):
            raise TypeError(
                f"collective_rpc needs a method name or a callable, got {type(method).__name__}"
            )
        if (
            method == "update_weights"
        ):  # new weights only while nothing is in flight, as update_weights
            self._check_paused_for("collective_rpc('update_weights')")
        return self.executor.collective_rpc(method, tuple(args), dict(kwargs or {}))

    def _check_paused_for(self, what: str) -> None:
        if not self.pause_effective():
            raise EngineNotPausedError(
                f"{what} needs a paused engine: call pause_generation() and let it take effect first"
            )

    def shutdown(self) -> None:
        """Apply what is in flight, then stop the executor's workers (also when a worker has died)."""
        try:
            self.drain()
        except Exception:
            logger.warning("batches in flight were lost at shutdown", exc_info=True)
            self.batch_queue.clear()
        finally:
            self.executor.shutdown()
            if self.structured_output_manager is not None:
                self.structured_output_manager.shutdown()
