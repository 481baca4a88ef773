"""EngineCore: the scheduler and the executor, stepped together."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvflow.core.sched.async_scheduler import AsyncScheduler
from kvflow.core.sched.scheduler import Scheduler
from kvflow.executor.uniproc import UniProcExecutor
from kvflow.request import RequestStatus

if TYPE_CHECKING:
    from kvflow.config import EngineConfig
    from kvflow.core.sched.output import EngineCoreOutput
    from kvflow.model_info import ModelInfo
    from kvflow.request import Request

logger = logging.getLogger(__name__)


class EngineCore:
    """Owns one scheduler and one executor. `step()` = schedule -> execute -> update_from_output.

    Invariant: a step runs whenever there is work or the worker still has to hear about finished/preempted
    requests, so every slot release reaches the worker before any admission that relies on it.
    """

    def __init__(self, engine_config: EngineConfig, model_info: ModelInfo | None = None) -> None:
        self.engine_config = engine_config
        self.executor = UniProcExecutor(engine_config, model_info)
        scheduler_config = engine_config.scheduler_config
        scheduler_cls = AsyncScheduler if scheduler_config.async_scheduling else Scheduler
        self.scheduler = scheduler_cls(scheduler_config, engine_config.cache_config,
                                       num_kv_blocks=self.executor.num_kv_blocks)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.scheduler.has_pending_reports()

    def step(self) -> list[EngineCoreOutput]:
        """Run one engine step; returns the per-request outputs it produced (empty when idle)."""
        if not self.has_work():
            return []
        scheduler_output = self.scheduler.schedule()
        model_runner_output = self.executor.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, model_runner_output)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self.scheduler.reset_prefix_cache(reset_running_requests)

    def shutdown(self) -> None:
        self.executor.shutdown()
