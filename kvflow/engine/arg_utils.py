"""EngineArgs: every engine option, declared once, with its default and help text.

`LLM(**kwargs)`, `AsyncLLM(**kwargs)`, the CLI (`add_cli_args` / `from_cli_args`) and `kvflow serve` all build an
`EngineArgs`, so an option is spelled, defaulted, documented and validated in exactly one place.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union, get_args, get_origin, get_type_hints

from kvflow.config import (
    DEFAULT_CPU_KV_CACHE_SPACE_BYTES,
    DTYPES,
    EXECUTOR_BACKENDS,
    GIB,
    SCHEDULING_POLICIES,
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)
from kvflow.models.quantization import QUANTIZATION_METHODS, check_quantization
from kvflow.pooling_params import RUNNER_TYPES, PoolerConfig
from kvflow.reasoning import REASONING_PARSERS
from kvflow.tracing import check_otel_available
from kvflow.utils import resolve_device

if TYPE_CHECKING:
    from kvflow.model_info import ModelInfo
    from kvflow.pooling.model_spec import PoolingModelSpec

logger = logging.getLogger(__name__)

# Tokens per step when not given: on CPU, steps of ~2k tokens keep activations cache-resident; GPUs want bigger
# steps.
_DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 2048, "cuda": 8192}
# The CPU KV cache budget in GiB (vLLM CPU's VLLM_CPU_KVCACHE_SPACE); unset, empty or 0: 4 GiB.
CPU_KVCACHE_SPACE_ENV = "KVFLOW_CPU_KVCACHE_SPACE"
REASONING_PARSER_NAMES = REASONING_PARSERS.names()
QUANTIZATION_CHOICES = QUANTIZATION_METHODS.names()


def _option(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A field with its CLI help (and allowed values, checked on construction)."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class EngineArgs:
    """The engine's options, as users pass them (`LLM(model, **options)`, `--kebab-case` flags).

    Invariants: after construction every field has its declared type (ValueError naming the field otherwise) and
    every field with choices holds one of them; `create_engine_config` does the checks that need the model.
    """

    model: str | None = _option(
        None,
        "Hugging Face checkpoint folder, a llama.cpp GGUF file (*.gguf; weights kept in their quantized "
        "blocks), or an org/name id already in the local Hugging Face cache (nothing is downloaded); default: "
        "the built-in default model (created locally on first use); 'hash': the deterministic test model",
    )
    tokenizer: str | None = _option(
        None,
        "tokenizer folder (default: the model's; for a GGUF file the original checkpoint's folder, unless the "
        "file holds a Hugging Face tokenizer)",
    )
    revision: str | None = _option(
        None,
        "with a Hugging Face id as the model: the cached snapshot's branch, tag or commit (default: main)",
    )
    skip_tokenizer_init: bool = _option(
        False, "load no tokenizer: prompts must be token ids, outputs carry no text"
    )
    dtype: str = _option(
        "auto",
        "weight and activation dtype ('auto': the checkpoint's; the pooling runner serves a float32 checkpoint "
        "in bfloat16 on a CPU with native bf16, in float16 on CUDA)",
        DTYPES,
    )
    max_model_len: int | None = _option(
        None, "longest sequence (prompt + output) in tokens; default: the model's limit"
    )
    max_num_seqs: int = _option(128, "most requests holding a worker slot at once")
    max_num_batched_tokens: int | None = _option(
        None, "most tokens per engine step; default: 2048 on CPU, 8192 on CUDA"
    )
    block_size: int = _option(16, "tokens per KV cache block")
    num_kv_blocks: int | None = _option(None, "KV cache blocks (overrides --kv-cache-memory-bytes)")
    kv_cache_memory_bytes: int | None = _option(
        None,
        "KV cache size in bytes (overrides the automatic size: on CPU $KVFLOW_CPU_KVCACHE_SPACE GiB, default 4, "
        "at most half the available memory; on CUDA see --gpu-memory-utilization)",
    )
    gpu_memory_utilization: float = _option(
        0.9,
        "CUDA: the fraction of the device's total memory this engine may use (weights, KV cache, "
        "activations); the KV cache gets this share minus the memory already in use on the device",
    )
    enable_prefix_caching: bool = _option(True, "reuse the KV blocks of shared prompt prefixes")
    enable_chunked_prefill: bool = _option(True, "split long prompts across engine steps")
    async_scheduling: bool = _option(True, "plan step N+1 while step N runs (overlapped steps)")
    scheduling_policy: str = _option("fcfs", "admission and preemption order", SCHEDULING_POLICIES)
    seed: int = _option(0, "engine seed: draws of requests without their own seed")
    quantization: str | None = _option(
        None,
        "'int8': weight-only int8 with a float32 scale per output channel, quantized at load from a float "
        "checkpoint (every linear layer; the embedding and the LM head stay in the model dtype); 'gguf': the "
        "model is a GGUF file (implied by a .gguf path)",
        QUANTIZATION_CHOICES,
    )
    quantize_lm_head: bool = _option(
        False, "with --quantization int8: quantize the LM head too (an int8 copy when tied)"
    )
    tensor_parallel_size: int = _option(
        1,
        "tensor-parallel ranks: each holds 1/N of the model's heads, MLP and vocabulary, and of the KV cache "
        "(torch.distributed: gloo on CPU, NCCL on CUDA)",
    )
    distributed_executor_backend: str | None = _option(
        None,
        "how the ranks run: 'uni' (in-process, one rank), 'mp' (worker processes on this machine), 'ray' "
        "(Ray actors; pip install 'kvflow[ray]'); default: 'uni' at one rank, 'mp' above",
        EXECUTOR_BACKENDS,
    )
    data_parallel_size: int = _option(
        1,
        "engine cores behind one front end, each in its own process with its own scheduler, KV cache (each "
        "sized as for one core) and workers; requests go to the least loaded",
    )
    long_prefill_token_threshold: int = _option(
        0, "cap on one request's prefill tokens per step (0: no cap)"
    )
    use_v2_model_runner: bool = _option(
        True, "slot model runner protocol (off: the persistent-batch protocol)"
    )
    device: str = _option("auto", "'auto' (CUDA when present), 'cpu', 'cuda' or 'cuda:N'")
    generation_config: str = _option(
        "auto",
        "defaults of requests without sampling params: 'auto' (the checkpoint's generation_config.json: "
        "temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), 'kvflow' or 'vllm' "
        "(kvflow's own defaults), or a folder holding a generation_config.json",
    )
    max_logprobs: int = _option(20, "most logprobs a request may ask for (-1: no cap)")
    engine_process: bool = _option(
        False,
        "run the engine core in its own process, behind ZMQ (`kvflow serve` turns it on; LLM and AsyncLLM run "
        "it on a thread of their own process without it)",
    )
    structured_outputs_config: dict | None = _option(  # noqa: RUF009 (None default)
        None,
        'structured outputs, as JSON: {"backend": "xgrammar" | "guidance" | "auto", "reasoning_parser": NAME, '
        '"enable_in_reasoning": false, "max_choices": 4096, "max_alternatives": 4096, "max_constraint_chars": '
        '65536, "compile_timeout_s": 5} (backend: default xgrammar; auto: xgrammar, and guidance for what '
        "xgrammar cannot compile or enforce; see --reasoning-parser; enable_in_reasoning: constrain the reasoning "
        "too; the max_* limits refuse costlier constraints before they are queued; compile_timeout_s: see "
        "--structured-outputs-compile-timeout)",
    )
    structured_outputs_compile_timeout: float | None = _option(
        None,
        "seconds a request's constraint may take to compile (default 5); past it the request ends with an error "
        "naming its constraint field (HTTP 400) and other requests are untouched (same as "
        'structured_outputs_config {"compile_timeout_s": S})',
    )
    reasoning_parser: str | None = _option(
        None,
        "how the model marks its reasoning (<think>...</think>): the server returns it as message.reasoning, "
        "and a structured-output constraint starts only once the reasoning has ended (same as "
        'structured_outputs_config {"reasoning_parser": NAME})',
        REASONING_PARSER_NAMES,
    )
    speculative_config: dict | None = _option(  # noqa: RUF009 (None default)
        None,
        'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 5, '
        '"prompt_lookup_min": 2} (drafts K tokens by prompt lookup in the request\'s own tokens and verifies '
        'them in one step), or {"method": "draft_model", "model": PATH, "num_speculative_tokens": K} (drafts '
        'with a smaller model that shares the tokenizer; "default-draft" is the built-in model\'s draft)',
    )
    enable_lora: bool = _option(
        False,
        "serve LoRA adapters beside the base model: requests may name a PEFT adapter (LoRARequest; the server's "
        "`model: <adapter name>`); requests with different adapters share a step",
    )
    max_loras: int = _option(
        1, "with --enable-lora: most distinct adapters in one step (the worker's slots)"
    )
    max_lora_rank: int = _option(16, "with --enable-lora: largest adapter rank accepted")
    max_cpu_loras: int | None = _option(
        None, "with --enable-lora: loaded adapters kept in memory (default: --max-loras)"
    )
    runner: str = _option(
        "auto",
        "'generate' (sample tokens), 'pooling' (embeddings, classification, scores: LLM.embed / classify / "
        "score / encode and the server's /v1/embeddings, /v1/score, /v1/rerank, /classify, /pooling), or "
        "'auto': pooling for embedding and classification checkpoints (BertModel, *ForSequenceClassification, "
        "a sentence-transformers folder), else generate",
        RUNNER_TYPES,
    )
    pooler_config: dict | None = _option(  # noqa: RUF009 (None default)
        None,
        'with runner pooling, as JSON: {"pooling_type": "LAST"|"MEAN"|"CLS"|"ALL", "normalize": bool, '
        '"dimensions": N, "use_activation": bool} (default: the checkpoint\'s sentence-transformers settings, '
        "else CLS for encoders and LAST for decoders, normalized)",
    )
    disable_log_stats: bool = _option(
        False,
        "no periodic throughput / scheduler stats in the log (every $KVFLOW_LOG_STATS_INTERVAL s)",
    )
    otlp_traces_endpoint: str | None = _option(
        None,
        "OpenTelemetry collector URL: export one span per finished request (vLLM's llm_request span and "
        "gen_ai.* attributes) over OTLP, gRPC unless $OTEL_EXPORTER_OTLP_TRACES_PROTOCOL is http/protobuf; "
        "needs pip install 'kvflow[otel]'",
    )

    def __post_init__(self) -> None:
        for path_option in ("model", "tokenizer"):  # accept pathlib paths for folders
            if isinstance(getattr(self, path_option), os.PathLike):
                setattr(self, path_option, os.fspath(getattr(self, path_option)))
        # vLLM takes the PoolerConfig object as well as its dict.
        if isinstance(self.pooler_config, PoolerConfig):
            self.pooler_config = {
                f.name: getattr(self.pooler_config, f.name)
                for f in dataclasses.fields(PoolerConfig)
                if getattr(self.pooler_config, f.name) is not None
            }
        hints = get_type_hints(EngineArgs)
        for option in dataclasses.fields(self):
            value = getattr(self, option.name)
            _check_type(option.name, value, hints[option.name])
            choices = option.metadata["choices"]
            if choices is not None and value is not None and value not in choices:
                raise ValueError(f"{option.name} must be one of {choices}, got {value!r}")
        resolve_device(
            self.device
        )  # an unknown or absent device is a ValueError now, not at load time
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size != 1:
            raise ValueError(
                "distributed_executor_backend 'uni' runs a single rank; tensor_parallel_size="
                f"{self.tensor_parallel_size} needs 'mp' or 'ray'"
            )
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        self._structured_outputs_config()  # checked now
        self._speculative_config()
        self._lora_config()
        PoolerConfig.from_option(self.pooler_config)
        if self.otlp_traces_endpoint is not None:
            check_otel_available()

    # ------------------------------------------------------------------------------------------------ config
    def create_engine_config(self, model_info: ModelInfo) -> EngineConfig:
        """The frozen configs for this model (their constructors validate each value)."""
        if self.max_model_len is not None and self.max_model_len > model_info.max_model_len:
            raise ValueError(
                f"max_model_len={self.max_model_len} is larger than the model supports "
                f"({model_info.max_model_len})"
            )
        from kvflow.models.quantization.gguf_file import GGUFCheckpoint, is_gguf_file

        is_gguf = is_gguf_file(model_info.path)
        check_quantization(
            self.quantization, is_gguf=is_gguf, quantize_lm_head=self.quantize_lm_head
        )
        tokenizer = self.tokenizer
        if is_gguf and tokenizer is None and not self.skip_tokenizer_init:
            assert model_info.path is not None
            tokenizer = GGUFCheckpoint(model_info.path).tokenizer_source()
        # `is None`, not `or`: max_model_len=0 is a mistake to report, not "unset".
        max_model_len = (
            self.max_model_len if self.max_model_len is not None else model_info.max_model_len
        )
        pooling = self._pooling_spec(model_info)
        chunked_prefill = self.enable_chunked_prefill and _pools_by_prefix(pooling)
        return EngineConfig(
            model_config=ModelConfig(
                model=str(model_info.path) if model_info.path else model_info.name,
                tokenizer=tokenizer,
                skip_tokenizer_init=self.skip_tokenizer_init,
                dtype=self.dtype,
                quantization=self.quantization,
                quantize_lm_head=self.quantize_lm_head,
                max_model_len=max_model_len,
                seed=self.seed,
                device=self.device,
                generation_config=self.generation_config,
                max_logprobs=self.max_logprobs,
                runner="generate" if pooling is None else "pooling",
                pooling=pooling,
            ),
            cache_config=CacheConfig(
                block_size=self.block_size,
                num_kv_blocks=self.num_kv_blocks,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                enable_prefix_caching=self.enable_prefix_caching and _pools_by_prefix(pooling),
                gpu_memory_utilization=self.gpu_memory_utilization,
                cpu_kv_cache_space_bytes=cpu_kv_cache_space_bytes(),
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self._max_num_batched_tokens(max_model_len, chunked_prefill),
                max_model_len=max_model_len,
                enable_chunked_prefill=chunked_prefill,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                policy=self.scheduling_policy,  # type: ignore[arg-type]
                # A pooling step's requests finish with it: nothing to overlap with the next step.
                async_scheduling=self.async_scheduling and pooling is None,
                use_v2_model_runner=self.use_v2_model_runner,
            ),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                distributed_executor_backend=self.distributed_executor_backend,
            ),
            structured_outputs_config=self._structured_outputs_config(),
            speculative_config=self._speculative_config(),
            lora_config=self._lora_config(),
        )

    def _lora_config(self) -> LoRAConfig | None:
        """The LoRA limits with `enable_lora`, else None; a limit given without `enable_lora` is a ValueError
        naming it (it would be silently ignored)."""
        if not self.enable_lora:
            for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
                option = next(o for o in dataclasses.fields(self) if o.name == name)
                if getattr(self, name) != option.default:
                    raise ValueError(f"{name} needs enable_lora=True (--enable-lora)")
            return None
        return LoRAConfig(
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            max_cpu_loras=self.max_cpu_loras,
        )

    def _structured_outputs_config(self) -> StructuredOutputsConfig:
        """`structured_outputs_config` with `reasoning_parser` and `structured_outputs_compile_timeout` folded in
        (both places may give one, if they agree)."""
        option = dict(self.structured_outputs_config or {})
        if self.reasoning_parser is not None:
            in_option = option.setdefault("reasoning_parser", self.reasoning_parser)
            if in_option != self.reasoning_parser:
                raise ValueError(
                    f"reasoning_parser={self.reasoning_parser!r} and structured_outputs_config "
                    f"reasoning_parser={in_option!r} disagree: give one"
                )
        if self.structured_outputs_compile_timeout is not None:
            timeout = self.structured_outputs_compile_timeout
            in_option = option.setdefault("compile_timeout_s", timeout)
            if in_option != timeout:
                raise ValueError(
                    f"structured_outputs_compile_timeout={timeout!r} and structured_outputs_config "
                    f"compile_timeout_s={in_option!r} disagree: give one"
                )
        return StructuredOutputsConfig.from_option(option)

    def _speculative_config(self) -> SpeculativeConfig | None:
        """`speculative_config` parsed; a method the engine does not run yet is a ValueError now."""
        config = SpeculativeConfig.from_option(self.speculative_config)
        if config is not None and config.method == "draft_model" and self.tensor_parallel_size > 1:
            raise ValueError(
                "speculative_config method 'draft_model' runs with tensor_parallel_size=1 (got "
                f"{self.tensor_parallel_size}); use method 'ngram' with tensor parallelism"
            )
        return config

    def _max_num_batched_tokens(self, max_model_len: int, chunked_prefill: bool) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        default = _DEFAULT_MAX_NUM_BATCHED_TOKENS[resolve_device(self.device).type]
        return default if chunked_prefill else max(default, max_model_len)

    def _pooling_spec(self, model_info: ModelInfo) -> PoolingModelSpec | None:
        """The model's pooling spec when it runs with the pooling runner (None: it generates); the options a
        pooling engine does not run are ValueErrors naming them."""
        from kvflow.pooling.model_spec import load_pooling_model_spec, resolve_runner

        runner = resolve_runner(self.runner, model_info.architecture, model_info.path)
        if runner == "generate":
            if self.pooler_config is not None:
                raise ValueError("pooler_config needs runner='pooling' (--runner pooling)")
            return None
        refused = {
            "speculative_config": self.speculative_config is not None,
            "enable_lora": self.enable_lora,
            "quantization": self.quantization is not None,
            "tensor_parallel_size": self.tensor_parallel_size != 1,
            "use_v2_model_runner": not self.use_v2_model_runner,
        }
        for option, given in refused.items():
            if given:
                raise ValueError(
                    f"{option}: not supported with runner='pooling' (embedding and classification models "
                    "run unquantized on one rank, with the slot runner, without adapters or speculation)"
                )
        assert model_info.path is not None
        spec = load_pooling_model_spec(model_info.path, model_info.architecture, self.pooler_config)
        if not _pools_by_prefix(spec) and self.max_num_batched_tokens is not None:
            max_model_len = self.max_model_len or model_info.max_model_len
            if self.max_num_batched_tokens < max_model_len:
                raise ValueError(
                    f"max_num_batched_tokens={self.max_num_batched_tokens} is less than max_model_len="
                    f"{max_model_len}: this model encodes each input whole in one step (pooling type "
                    f"{spec.pooler_config.pooling_type}{'' if spec.is_causal else ', bidirectional attention'})"
                )
        return spec

    # ------------------------------------------------------------------------------------------------ CLI
    @classmethod
    def add_cli_args(
        cls, parser: argparse.ArgumentParser, *, exclude: tuple[str, ...] = ()
    ) -> argparse.ArgumentParser:
        """Add one `--kebab-case` flag per field (booleans as `--flag/--no-flag`), in an "engine" group."""
        group = parser.add_argument_group("engine")
        hints = get_type_hints(cls)
        for option in dataclasses.fields(cls):
            if option.name in exclude:
                continue
            flag = "--" + option.name.replace("_", "-")
            help_text = option.metadata["help"]
            if option.default is not None:
                help_text += f" (default: {option.default})"
            value_type = _value_type(hints[option.name])
            if value_type is dict:
                value_type = _json_object  # type: ignore[assignment]
            if value_type is bool:
                group.add_argument(
                    flag,
                    action=argparse.BooleanOptionalAction,
                    default=option.default,
                    help=help_text,
                )
            else:
                group.add_argument(
                    flag,
                    type=value_type,
                    default=option.default,
                    choices=option.metadata["choices"],
                    help=help_text,
                )
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The EngineArgs of a namespace parsed with `add_cli_args` (fields it lacks keep their defaults)."""
        names = (option.name for option in dataclasses.fields(cls))
        return cls(**{name: getattr(args, name) for name in names if hasattr(args, name)})


def _pools_by_prefix(pooling: PoolingModelSpec | None) -> bool:
    """Whether a prompt may run in several steps and reuse cached prefixes: always when generating; for pooling,
    only a causal model pooling its last token (its earlier tokens' states are never needed again)."""
    return pooling is None or (pooling.is_causal and pooling.pooler_config.pooling_type == "LAST")


def cpu_kv_cache_space_bytes(environ: Mapping[str, str] = os.environ) -> int:
    """The CPU KV cache budget: `KVFLOW_CPU_KVCACHE_SPACE` GiB (a positive number; unset, empty or 0 mean the
    default, 4 GiB, as vLLM's VLLM_CPU_KVCACHE_SPACE). A malformed value is a ValueError naming the variable."""
    raw = environ.get(CPU_KVCACHE_SPACE_ENV, "").strip()
    if not raw:
        return DEFAULT_CPU_KV_CACHE_SPACE_BYTES
    try:
        space_gib = float(raw)
    except ValueError:
        space_gib = math.nan
    if not math.isfinite(space_gib) or space_gib < 0:
        raise ValueError(
            f"{CPU_KVCACHE_SPACE_ENV} must be the CPU KV cache size in GiB (a number >= 0; 0 or unset: "
            f"4 GiB), got {raw!r}"
        )
    if space_gib == 0:
        return DEFAULT_CPU_KV_CACHE_SPACE_BYTES
    return max(1, int(space_gib * GIB))


def _json_object(text: str) -> dict:
    """A CLI value that is a JSON object (argparse reports the ValueError as a usage error)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


_json_object.__name__ = "JSON object"


def _value_type(annotation: Any) -> type:
    """`int` for `int` and `int | None`."""
    if get_origin(annotation) in (Union, types.UnionType):
        [value_type] = [arg for arg in get_args(annotation) if arg is not type(None)]
        return value_type
    return annotation


def _check_type(name: str, value: Any, annotation: Any) -> None:
    if value is None and type(None) in get_args(annotation):
        return
    expected = _value_type(annotation)
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return  # an int is a fine float (gpu_memory_utilization=1)
    # bool is an int subclass: `max_num_seqs=True` is a mistake, not 1.
    if not isinstance(value, expected) or (expected in (int, float) and isinstance(value, bool)):
        raise ValueError(f"{name} must be {_type_name(annotation)}, got {value!r}")


def _type_name(annotation: Any) -> str:
    """'int', 'int or None'."""
    names = [arg.__name__ for arg in get_args(annotation)] or [annotation.__name__]
    return " or ".join(name if name != "NoneType" else "None" for name in names)
