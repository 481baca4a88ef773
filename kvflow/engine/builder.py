"""Builds an engine from `LLM`/`AsyncLLM` keyword arguments: model info, tokenizer, config, core, processors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvflow.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from kvflow.engine.core import EngineCore
from kvflow.engine.input_processor import InputProcessor
from kvflow.engine.output_processor import OutputProcessor
from kvflow.model_info import ModelInfo, resolve_model_info
from kvflow.utils import resolve_device

if TYPE_CHECKING:
    from kvflow.tokenizer import Tokenizer

# Tokens per step when not given: on CPU, chunks of ~2k tokens keep activations cache-resident (elementwise ops on
# [8192, intermediate] tensors run ~2x slower per element and matmuls lose ~10%); GPUs want bigger steps.
_DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 2048, "cuda": 8192}


@dataclass
class EngineParts:
    """Everything a front end needs: the core plus the processors on either side of it."""

    engine_config: EngineConfig
    model_info: ModelInfo
    tokenizer: Tokenizer | None
    engine_core: EngineCore
    input_processor: InputProcessor
    output_processor: OutputProcessor


def build_engine(
    model: str | None = None,
    *,
    tokenizer: str | None = None,
    skip_tokenizer_init: bool = False,
    dtype: str = "auto",
    max_model_len: int | None = None,
    max_num_seqs: int = 128,
    max_num_batched_tokens: int | None = None,
    block_size: int = 16,
    num_kv_blocks: int | None = None,
    kv_cache_memory_bytes: int | None = None,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
    async_scheduling: bool = True,
    scheduling_policy: str = "fcfs",
    seed: int = 0,
    tensor_parallel_size: int = 1,
    distributed_executor_backend: str | None = None,
    long_prefill_token_threshold: int = 0,
    use_v2_model_runner: bool = True,
    device: str = "auto",
) -> EngineParts:
    """Validate the arguments, resolve the model (building the default one if needed) and start the core."""
    if tensor_parallel_size != 1 or distributed_executor_backend not in (None, "uni"):
        raise ValueError(
            "tensor_parallel_size > 1 and distributed executors are not available in this build"
        )
    model_info = resolve_model_info(model)
    if max_model_len is not None and max_model_len > model_info.max_model_len:
        raise ValueError(
            f"max_model_len={max_model_len} is larger than the model supports "
            f"({model_info.max_model_len})"
        )
    max_model_len = max_model_len or model_info.max_model_len
    if max_num_batched_tokens is None:
        default_tokens = _DEFAULT_MAX_NUM_BATCHED_TOKENS[resolve_device(device).type]
        max_num_batched_tokens = (
            default_tokens if enable_chunked_prefill else max(default_tokens, max_model_len)
        )
    loaded_tokenizer = _load_tokenizer(model_info, tokenizer, skip_tokenizer_init)
    engine_config = EngineConfig(
        model_config=ModelConfig(
            model=str(model_info.path) if model_info.path else model_info.name,
            tokenizer=tokenizer,
            skip_tokenizer_init=skip_tokenizer_init,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            device=device,
        ),
        cache_config=CacheConfig(
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            enable_prefix_caching=enable_prefix_caching,
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
            long_prefill_token_threshold=long_prefill_token_threshold,
            policy=scheduling_policy,  # type: ignore[arg-type]
            async_scheduling=async_scheduling,
            use_v2_model_runner=use_v2_model_runner,
        ),
        parallel_config=ParallelConfig(
            tensor_parallel_size=tensor_parallel_size,
            distributed_executor_backend=distributed_executor_backend,
        ),
    )
    engine_core = EngineCore(engine_config, model_info)
    capacity = engine_core.executor.num_kv_blocks * block_size
    if capacity < max_model_len:
        engine_core.shutdown()
        raise ValueError(
            f"max_model_len={max_model_len} does not fit in the KV cache ({capacity} tokens); "
            "lower max_model_len or raise num_kv_blocks / kv_cache_memory_bytes"
        )
    return EngineParts(
        engine_config,
        model_info,
        loaded_tokenizer,
        engine_core,
        InputProcessor(model_info, loaded_tokenizer, max_model_len),
        OutputProcessor(loaded_tokenizer),
    )


def _load_tokenizer(
    model_info: ModelInfo, tokenizer: str | None, skip_tokenizer_init: bool
) -> Tokenizer | None:
    if skip_tokenizer_init or (tokenizer is None and model_info.path is None):
        return None
    from kvflow.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer if tokenizer is not None else model_info.path)
