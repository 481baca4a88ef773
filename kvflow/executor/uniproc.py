"""UniProcExecutor: one worker in the engine's own process."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvflow.core.kv_cache_manager import cdiv
from kvflow.worker.worker import Worker

if TYPE_CHECKING:
    from kvflow.config import EngineConfig
    from kvflow.core.sched.output import ModelRunnerOutput, SchedulerOutput

# The hash model's KV cache holds one int64 per token slot.
_HASH_MODEL_BYTES_PER_TOKEN = 8
_MAX_DEFAULT_BLOCKS = 65536


def determine_num_kv_blocks(engine_config: EngineConfig) -> int:
    """`num_kv_blocks` if set, else what `kv_cache_memory_bytes` buys, else room for every slot at full length."""
    cache_config = engine_config.cache_config
    if cache_config.num_kv_blocks is not None:
        return cache_config.num_kv_blocks
    if cache_config.kv_cache_memory_bytes is not None:
        bytes_per_block = cache_config.block_size * _HASH_MODEL_BYTES_PER_TOKEN
        num_blocks = cache_config.kv_cache_memory_bytes // bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory_bytes={cache_config.kv_cache_memory_bytes} holds no KV block "
                             f"({bytes_per_block} bytes each)")
        return num_blocks
    scheduler_config = engine_config.scheduler_config
    blocks_per_seq = cdiv(scheduler_config.max_model_len, cache_config.block_size)
    return min(scheduler_config.max_num_seqs * blocks_per_seq, _MAX_DEFAULT_BLOCKS)


class UniProcExecutor:
    """Runs a single `Worker` in-process; `execute_model` is a direct call."""

    def __init__(self, engine_config: EngineConfig) -> None:
        self.num_kv_blocks = determine_num_kv_blocks(engine_config)
        self.worker = Worker(engine_config, self.num_kv_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        """Nothing to tear down in-process."""
