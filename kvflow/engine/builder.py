"""Builds an engine from `EngineArgs`: model info, tokenizer, config, core, and the processors around it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvflow.engine.core import EngineCore
from kvflow.engine.input_processor import InputProcessor
from kvflow.engine.output_processor import OutputProcessor
from kvflow.model_info import ModelInfo, resolve_model_info

if TYPE_CHECKING:
    from kvflow.config import EngineConfig
    from kvflow.engine.arg_utils import EngineArgs
    from kvflow.tokenizer import Tokenizer


@dataclass
class EngineParts:
    """Everything a front end needs: the core plus the processors on either side of it."""

    engine_config: EngineConfig
    model_info: ModelInfo
    tokenizer: Tokenizer | None
    engine_core: EngineCore
    input_processor: InputProcessor
    output_processor: OutputProcessor


def build_engine(engine_args: EngineArgs) -> EngineParts:
    """Resolve the model (building the default one if needed), validate the options against it, start the core."""
    model_info = resolve_model_info(engine_args.model)
    engine_config = engine_args.create_engine_config(model_info)
    tokenizer = _load_tokenizer(model_info, engine_args.tokenizer, engine_args.skip_tokenizer_init)
    engine_core = EngineCore(engine_config, model_info)
    block_size = engine_config.cache_config.block_size
    kv_capacity_tokens = engine_core.executor.num_kv_blocks * block_size
    max_model_len = engine_config.scheduler_config.max_model_len
    if kv_capacity_tokens < max_model_len:
        engine_core.shutdown()
        raise ValueError(
            f"max_model_len={max_model_len} does not fit in the KV cache ({kv_capacity_tokens} tokens); "
            "lower max_model_len or raise num_kv_blocks / kv_cache_memory_bytes"
        )
    input_processor = InputProcessor(
        model_info, tokenizer, max_model_len, engine_config.model_config
    )
    return EngineParts(
        engine_config,
        model_info,
        tokenizer,
        engine_core,
        input_processor,
        OutputProcessor(tokenizer),
    )


def _load_tokenizer(
    model_info: ModelInfo, tokenizer: str | None, skip_tokenizer_init: bool
) -> Tokenizer | None:
    if skip_tokenizer_init or (tokenizer is None and model_info.path is None):
        return None
    from kvflow.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer if tokenizer is not None else model_info.path)
