"""Builds an engine from `EngineArgs`, in two halves that may live in different processes.

* `build_frontend`: what the API side needs (model info, configs, tokenizer, input and output processors); no model,
  no KV cache, no torch compute.
* `build_engine_core` (`kvflow.engine.core_builder`, below the clients, which the engine-core process imports):
  the core (scheduler + executor + worker + model), in the engine-core process when `EngineArgs.engine_process` is
  on, else in this one.

`start_engine_core_client` starts the core behind the client both front ends (`LLM`, `AsyncLLM`) drive it through:
on a thread of this process, in an engine-core process of its own, or several of them (data parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvflow.engine.core_builder import build_engine_core
from kvflow.engine.input_processor import InputProcessor
from kvflow.engine.output_processor import OutputProcessor
from kvflow.model_info import ModelInfo, resolve_model_info
from kvflow.tracing import build_request_tracer

if TYPE_CHECKING:
    from kvflow.config import EngineConfig
    from kvflow.engine.arg_utils import EngineArgs
    from kvflow.engine.core_client import EngineCoreClient
    from kvflow.engine.death import DeadHandler
    from kvflow.engine.loop import OutputHandler
    from kvflow.engine.shared_engines import EngineAttachment
    from kvflow.tokenizer import Tokenizer


@dataclass
class FrontendParts:
    """The front end's half: configs, model info, tokenizer and the processors on either side of the core."""

    engine_config: EngineConfig
    model_info: ModelInfo
    tokenizer: Tokenizer | None
    input_processor: InputProcessor
    output_processor: OutputProcessor


def resolve_engine_config(engine_args: EngineArgs) -> tuple[ModelInfo, EngineConfig]:
    """Resolve the model (building the default one if needed) and validate the options against it."""
    model_info = resolve_model_info(engine_args.model, engine_args.revision)
    return model_info, engine_args.create_engine_config(model_info)


def build_frontend(
    engine_args: EngineArgs, model_info: ModelInfo, engine_config: EngineConfig
) -> FrontendParts:
    """The API side: tokenizer and processors. Needs no core: the KV cache is checked to hold `max_model_len` when
    the core is built, so the input processor's length checks hold for any KV capacity the core reports."""
    tokenizer = (
        _load_tokenizer(  # the config's tokenizer: a GGUF file's may be resolved from the file
            model_info, engine_config.model_config.tokenizer, engine_args.skip_tokenizer_init
        )
    )
    input_processor = InputProcessor(
        model_info,
        tokenizer,
        engine_config.scheduler_config.max_model_len,
        engine_config.model_config,
        engine_config.structured_outputs_config,
    )
    tracer = build_request_tracer(engine_args.otlp_traces_endpoint, model_info.name)
    return FrontendParts(
        engine_config, model_info, tokenizer, input_processor, OutputProcessor(tokenizer, tracer)
    )


def start_engine_core_client(
    frontend: FrontendParts,
    output_handler: OutputHandler,
    dead_handler: DeadHandler,
    engine_process: bool = False,
    data_parallel_size: int = 1,
) -> tuple[EngineCoreClient, int]:
    """The engine core behind its client, and the KV blocks a request can count on (with several cores, the
    smallest core's). With `data_parallel_size > 1`, that many cores, each in its own process; else with
    `engine_process`, one core in its own process (this process then runs no torch compute); else one core on a
    thread of this process. `output_handler` and `dead_handler` are the front end's (see `EngineCoreClient`).

    Inside `kvflow.engine.shared_engines.attached_engines(...)` (an API server of `kvflow serve --api-server-count
    N`), the client attaches to the running cores given there instead of starting any."""
    from kvflow.engine.shared_engines import current_attachments

    config, model_info = frontend.engine_config, frontend.model_info
    attachments = current_attachments()
    if attachments is not None:
        return _attach_engine_core_client(frontend, output_handler, dead_handler, attachments)
    if data_parallel_size > 1:
        from kvflow.engine.dp_client import DPEngineCoreClient

        dp_client = DPEngineCoreClient(
            config, model_info, output_handler, dead_handler, data_parallel_size
        )
        return dp_client, min(dp_client.num_kv_blocks_per_engine)
    if engine_process:
        from kvflow.engine.mp_client import MPEngineCoreClient

        mp_client = MPEngineCoreClient(config, model_info, output_handler, dead_handler)
        return mp_client, mp_client.num_kv_blocks
    from kvflow.engine.core_client import InprocEngineCoreClient
    from kvflow.executor import resolve_executor_backend

    if resolve_executor_backend(config.parallel_config) == "uni":
        # The model runs in this process: built on the loop thread that steps it (one OpenMP pool, see
        # `InprocEngineCoreClient.built_on_loop_thread`).
        client, engine_core = InprocEngineCoreClient.built_on_loop_thread(
            lambda: build_engine_core(config, model_info), output_handler, dead_handler
        )
    else:
        engine_core = build_engine_core(config, model_info)
        client = InprocEngineCoreClient(engine_core, output_handler, dead_handler)
    return client, engine_core.executor.num_kv_blocks


def _attach_engine_core_client(
    frontend: FrontendParts,
    output_handler: OutputHandler,
    dead_handler: DeadHandler,
    attachments: tuple[EngineAttachment, ...],
) -> tuple[EngineCoreClient, int]:
    """A client of engine cores that run already (one per data-parallel rank), shared with other front ends."""
    config, model_info = frontend.engine_config, frontend.model_info
    if len(attachments) > 1:
        from kvflow.engine.dp_client import DPEngineCoreClient

        dp_client = DPEngineCoreClient(
            config,
            model_info,
            output_handler,
            dead_handler,
            len(attachments),
            attachments=attachments,
        )
        return dp_client, min(dp_client.num_kv_blocks_per_engine)
    from kvflow.engine.mp_client import MPEngineCoreClient

    mp_client = MPEngineCoreClient(
        config, model_info, output_handler, dead_handler, attachment=attachments[0]
    )
    return mp_client, mp_client.num_kv_blocks


def _load_tokenizer(
    model_info: ModelInfo, tokenizer: str | None, skip_tokenizer_init: bool
) -> Tokenizer | None:
    if skip_tokenizer_init or (tokenizer is None and model_info.path is None):
        return None
    from kvflow.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer if tokenizer is not None else model_info.path)
