"""EngineCore: the scheduler and the executor, stepped together (synchronously or overlapped), plus pause/resume
and weight updates."""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Literal

from kvflow.core.sched.async_scheduler import AsyncScheduler
from kvflow.core.sched.output import EngineCoreOutput
from kvflow.core.sched.scheduler import PauseState, Scheduler
from kvflow.executor.uniproc import UniProcExecutor
from kvflow.request import RequestStatus

if TYPE_CHECKING:
    from kvflow.config import EngineConfig
    from kvflow.core.sched.output import ModelRunnerOutput, SchedulerOutput
    from kvflow.model_info import ModelInfo
    from kvflow.request import Request

logger = logging.getLogger(__name__)

PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES = ("abort", "wait", "keep")


class EngineCore:
    """Owns one scheduler and one executor.

    `step()` runs schedule -> execute -> update_from_output. With `async_scheduling` it overlaps instead
    (`step_with_batch_queue`): step N+1 is scheduled and step N-1's output processed while the worker runs step N.

    Invariants:
      * a step runs whenever there is work, a batch in flight, or the worker still has to hear about finished or
        preempted requests, so every slot release reaches the worker before any admission that relies on it;
      * at most `batch_queue_size` batches are in flight (1: synchronous), and their outputs are applied in order;
      * a pause "has taken effect" (`pause_effective`) only once no batch is in flight and, for mode "wait", no
        started request is left; its `clear_cache` reset runs exactly then, so no in-flight frame can be lost;
      * the weight version only changes while no batch is in flight; every output carries the version that
        computed its tokens.
    """

    def __init__(self, engine_config: EngineConfig, model_info: ModelInfo | None = None) -> None:
        self.engine_config = engine_config
        self.executor = UniProcExecutor(engine_config, model_info)
        scheduler_config = engine_config.scheduler_config
        scheduler_cls = AsyncScheduler if scheduler_config.async_scheduling else Scheduler
        self.scheduler = scheduler_cls(
            scheduler_config, engine_config.cache_config, num_kv_blocks=self.executor.num_kv_blocks
        )
        self.batch_queue_size = 2 if scheduler_config.async_scheduling else 1
        self.batch_queue: deque[tuple[SchedulerOutput, Future[ModelRunnerOutput], int]] = deque()
        self.weight_version = 0
        self._pause_mode: PauseMode | None = None
        self._pause_clear_cache = False
        self._pause_pending = False

    # ------------------------------------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_work(self) -> bool:
        return (
            bool(self.batch_queue)
            or self.scheduler.has_unfinished_requests()
            or self.scheduler.has_pending_reports()
        )

    def can_make_progress(self) -> bool:
        """False when the only work left is held by a pause (stepping would just spin)."""
        return bool(self.batch_queue) or self._has_schedulable_work()

    # ------------------------------------------------------------------------------------------------ stepping
    def step(self) -> list[EngineCoreOutput]:
        """Run one engine step; returns the per-request outputs it produced (empty when idle)."""
        if self.batch_queue_size > 1:
            return self.step_with_batch_queue()
        if not self.can_make_progress():
            return self._finish_pause_if_effective()
        scheduler_output = self.scheduler.schedule()
        model_runner_output = self.executor.execute_model(scheduler_output)
        outputs = self._update(scheduler_output, model_runner_output, self.weight_version)
        return outputs + self._finish_pause_if_effective()

    def step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """Overlapped step: launch the next batch if the queue has room, and apply the oldest batch's output once
        the queue is full or nothing new could be launched. The worker feeds each request's last sampled token into
        its next step itself, so step N+1 can be planned before step N's tokens are back."""
        launched = False
        if len(self.batch_queue) < self.batch_queue_size and self._has_schedulable_work():
            prev_step_scheduled_req_ids = self.scheduler.prev_step_scheduled_req_ids
            scheduler_output = self.scheduler.schedule()
            if (
                scheduler_output.total_num_scheduled_tokens > 0
                or scheduler_output.finished_req_ids
                or scheduler_output.preempted_req_ids
            ):
                future = self.executor.execute_model(scheduler_output, non_block=True)
                self.batch_queue.append((scheduler_output, future, self.weight_version))
                launched = True
            else:  # never sent: the worker's previous step is still the last one launched
                self.scheduler.prev_step_scheduled_req_ids = prev_step_scheduled_req_ids
        # While a pause is in effect only token-less report batches go out: apply them at once, so that no batch is
        # ever in flight while paused (update_weights and a repeated pause rely on it).
        if not self.batch_queue or (
            launched
            and len(self.batch_queue) < self.batch_queue_size
            and not self.pause_effective()
        ):
            return self._finish_pause_if_effective()
        scheduler_output, future, weight_version = self.batch_queue.popleft()
        outputs = self._update(scheduler_output, future.result(), weight_version)
        return outputs + self._finish_pause_if_effective()

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
        """Start a pause. "abort" finishes every unfinished request now (returned as "abort" outputs); "wait" lets
        started requests finish and holds new ones; "keep" schedules nothing. Requests added while paused are
        queued (counted, abortable) and run after `resume_generation`. Drive `step()` until `pause_effective()`;
        the `clear_cache` reset happens then. Pausing again while paused may change the mode."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        outputs: list[EngineCoreOutput] = []
        if mode == "abort":
            outputs = self._abort_all()
        self._pause_mode = mode  # type: ignore[assignment]
        self._pause_clear_cache = (
            self._pause_clear_cache or clear_cache if self._pause_pending else clear_cache
        )
        self._pause_pending = True
        self.scheduler.set_pause_state(
            PauseState.PAUSED_NEW if mode == "wait" else PauseState.PAUSED_ALL
        )
        return outputs + self._finish_pause_if_effective()

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
        return self._pause_mode is not None and not self._pause_pending

    def is_paused(self) -> bool:
        return self._pause_mode is not None

    def _finish_pause_if_effective(self) -> list[EngineCoreOutput]:
        if not self._pause_pending or self.batch_queue:
            return []
        if self._pause_mode == "wait" and self.scheduler.get_num_started_requests() > 0:
            return []
        self._pause_pending = False
        if self._pause_clear_cache:
            self.scheduler.reset_prefix_cache(reset_running_requests=True)
        self.scheduler.set_pause_state(
            PauseState.PAUSED_ALL
        )  # in effect: nothing runs until resume
        return []

    def resume_generation(self) -> None:
        """End the pause: held and frozen requests are scheduled again (preempted ones recompute)."""
        self._pause_mode = None
        self._pause_pending = False
        self._pause_clear_cache = False
        self.scheduler.set_pause_state(PauseState.UNPAUSED)

    # ------------------------------------------------------------------------------------------------ cache, weights
    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget cached prefixes; `reset_running_requests` preempts every running request first. Batches may be
        in flight: the scheduler discards exactly their stale frames of the preempted requests."""
        return self.scheduler.reset_prefix_cache(reset_running_requests)

    def drain(self) -> list[EngineCoreOutput]:
        """Apply every in-flight batch's output (nothing new is launched)."""
        outputs: list[EngineCoreOutput] = []
        while self.batch_queue:
            scheduler_output, future, weight_version = self.batch_queue.popleft()
            outputs += self._update(scheduler_output, future.result(), weight_version)
        return outputs

    def update_weights(self, weights: str | Any) -> int:
        """Load new weights (a checkpoint folder or a state dict of Hugging Face names) into the running model;
        returns the new weight version. Only while paused with nothing in flight (the RLHF loop: pause(keep) ->
        update_weights -> reset cache -> resume)."""
        if not self.pause_effective():
            raise RuntimeError(
                "update_weights needs a paused engine: call pause_generation() and let it take "
                "effect first"
            )
        assert not self.batch_queue
        self.executor.update_weights(weights)
        self.weight_version += 1
        logger.info("weights updated: version %d", self.weight_version)
        return self.weight_version

    def shutdown(self) -> None:
        self.drain()
        self.executor.shutdown()
