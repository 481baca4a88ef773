"""The worker: builds the model and the model runner (which owns the KV cache) and executes steps."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvflow.testing.hash_model import HashModel
from kvflow.worker.model_runner import ModelRunner, RunnerModel

if TYPE_CHECKING:
    from kvflow.config import EngineConfig, ModelConfig
    from kvflow.core.sched.output import ModelRunnerOutput, SchedulerOutput


def build_model(model_config: ModelConfig) -> RunnerModel:
    """The model named by `model_config`; only the hash model (`model="hash"`) exists so far."""
    if model_config.is_hash_model:
        return HashModel()
    raise NotImplementedError(f"model {model_config.model!r}: only model='hash' is supported so far")


class Worker:
    """One device's worker: a model plus the `ModelRunner` that holds its request slots and a KV cache of
    `num_kv_blocks` blocks. Its slot count is `max_num_seqs`, so the scheduler's admission bound matches it."""

    def __init__(self, engine_config: EngineConfig, num_kv_blocks: int,
                 device: str | torch.device = "cpu") -> None:
        scheduler_config = engine_config.scheduler_config
        self.engine_config = engine_config
        self.model = build_model(engine_config.model_config)
        self.model_runner = ModelRunner(
            self.model,
            max_num_reqs=scheduler_config.max_num_seqs,
            max_model_len=scheduler_config.max_model_len,
            block_size=engine_config.cache_config.block_size,
            num_blocks=num_kv_blocks,
            use_v2_model_runner=scheduler_config.use_v2_model_runner,
            device=device,
        )

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step."""
        return self.model_runner.execute_model(scheduler_output)
