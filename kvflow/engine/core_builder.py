"""Builds an engine core (scheduler + executor + worker + model) from its config, wherever the core runs: on a
thread of the front end's process (`kvflow.engine.builder`) or in an engine-core process (`kvflow.engine.core_proc`).

It sits below both, so the engine-core process never imports the clients that start it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvflow.config import EngineConfig
    from kvflow.engine.core import EngineCore
    from kvflow.model_info import ModelInfo


def build_engine_core(engine_config: EngineConfig, model_info: ModelInfo | None) -> EngineCore:
    """Start the core (loads the model and allocates the KV cache). ValueError, with the core released, when the
    KV cache cannot hold one sequence of `max_model_len` tokens."""
    from kvflow.engine.core import EngineCore  # imports the model code: only where the core runs

    engine_core = EngineCore(engine_config, model_info)
    block_size = engine_config.cache_config.block_size
    kv_capacity_tokens = engine_core.executor.num_kv_blocks * block_size
    max_model_len = engine_config.scheduler_config.max_model_len
    kv_cache_manager = engine_core.scheduler.kv_cache_manager
    # With sliding-window KV cache groups a sequence holds blocks in every group (`min_blocks_for`).
    if kv_cache_manager.min_blocks_for(max_model_len) > kv_cache_manager.num_usable_blocks:
        engine_core.shutdown()
        raise ValueError(
            f"max_model_len={max_model_len} does not fit in the KV cache ({kv_capacity_tokens} tokens); "
            "lower max_model_len or raise num_kv_blocks / kv_cache_memory_bytes"
        )
    return engine_core
