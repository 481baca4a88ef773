"""UniProcExecutor: one worker in the engine's own process."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvflow.worker.worker import Worker

if TYPE_CHECKING:
    from kvflow.config import EngineConfig
    from kvflow.core.sched.output import ModelRunnerOutput, SchedulerOutput
    from kvflow.model_info import ModelInfo


class UniProcExecutor:
    """Runs a single `Worker` in-process; `execute_model` is a direct call. `num_kv_blocks` is what the worker
    allocated, which the scheduler's KV cache manager must use."""

    def __init__(self, engine_config: EngineConfig, model_info: ModelInfo | None = None) -> None:
        self.worker = Worker(engine_config, model_info)
        self.num_kv_blocks = self.worker.num_kv_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        """Nothing to tear down in-process."""
