"""Builds an engine from `EngineArgs`, in two halves that may live in different processes.

* `build_frontend`: what the API side needs (model info, configs, tokenizer, input and output processors); no model,
  no KV cache, no torch compute.
* `build_engine_core`: the core (scheduler + executor + worker + model), in the engine-core process when
  `EngineArgs.engine_process` is on, else in this one.

`build_engine` builds both here, for `LLM` and the in-process `AsyncLLM`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvflow.engine.input_processor import InputProcessor
from kvflow.engine.output_processor import OutputProcessor
from kvflow.model_info import ModelInfo, resolve_model_info

if TYPE_CHECKING:
    from kvflow.config import EngineConfig
    from kvflow.engine.arg_utils import EngineArgs
    from kvflow.engine.core import EngineCore
    from kvflow.tokenizer import Tokenizer


@dataclass
class FrontendParts:
    """The front end's half: configs, model info, tokenizer and the processors on either side of the core."""

    engine_config: EngineConfig
    model_info: ModelInfo
    tokenizer: Tokenizer | None
    input_processor: InputProcessor
    output_processor: OutputProcessor


@dataclass
class EngineParts(FrontendParts):
    """Everything an in-process front end needs: its half plus the core itself."""

    engine_core: EngineCore


def resolve_engine_config(engine_args: EngineArgs) -> tuple[ModelInfo, EngineConfig]:
    """Resolve the model (building the default one if needed) and validate the options against it."""
    model_info = resolve_model_info(engine_args.model)
    return model_info, engine_args.create_engine_config(model_info)


def build_frontend(
    engine_args: EngineArgs, model_info: ModelInfo, engine_config: EngineConfig
) -> FrontendParts:
    """The API side: tokenizer and processors. Needs no core: the KV cache is checked to hold `max_model_len` when
    the core is built, so the input processor's length checks hold for any KV capacity the core reports."""
    tokenizer = _load_tokenizer(model_info, engine_args.tokenizer, engine_args.skip_tokenizer_init)
    input_processor = InputProcessor(
        model_info,
        tokenizer,
        engine_config.scheduler_config.max_model_len,
        engine_config.model_config,
    )
    return FrontendParts(
        engine_config, model_info, tokenizer, input_processor, OutputProcessor(tokenizer)
    )


def build_engine_core(engine_config: EngineConfig, model_info: ModelInfo | None) -> EngineCore:
    """Start the core (loads the model and allocates the KV cache). ValueError, with the core released, when the
    KV cache cannot hold one sequence of `max_model_len` tokens."""
    from kvflow.engine.core import EngineCore  # imports the model code: only where the core runs

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
    return engine_core


def build_engine(engine_args: EngineArgs) -> EngineParts:
    """Both halves in this process: resolve the model, validate the options, start the core, build the
    processors around it."""
    model_info, engine_config = resolve_engine_config(engine_args)
    frontend = build_frontend(engine_args, model_info, engine_config)
    engine_core = build_engine_core(engine_config, model_info)
    return EngineParts(
        frontend.engine_config,
        frontend.model_info,
        frontend.tokenizer,
        frontend.input_processor,
        frontend.output_processor,
        engine_core,
    )


def _load_tokenizer(
    model_info: ModelInfo, tokenizer: str | None, skip_tokenizer_init: bool
) -> Tokenizer | None:
    if skip_tokenizer_init or (tokenizer is None and model_info.path is None):
        return None
    from kvflow.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer if tokenizer is not None else model_info.path)
