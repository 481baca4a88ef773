"""Frozen engine configuration. Each field is declared once, here, and validated on construction."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from kvflow.reasoning import REASONING_PARSERS
from kvflow.spec_decode import SPEC_PROPOSERS

if TYPE_CHECKING:
    from kvflow.pooling.model_spec import PoolingModelSpec

SchedulingPolicyName = Literal["fcfs", "priority"]
# The allowed values of the choice options; `EngineArgs` offers the same lists on the command line.
DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULING_POLICIES: tuple[SchedulingPolicyName, ...] = ("fcfs", "priority")
EXECUTOR_BACKENDS = ("uni", "mp", "ray")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


# `ModelConfig.generation_config` values that name a source rather than a folder: "auto" reads the checkpoint's
# generation_config.json, "kvflow" (or vLLM's spelling, "vllm") ignores it.
GENERATION_CONFIG_SOURCES = ("auto", "kvflow", "vllm")
GIB = 1 << 30
# The CPU KV cache budget when KVFLOW_CPU_KVCACHE_SPACE is not set (vLLM CPU's VLLM_CPU_KVCACHE_SPACE default).
DEFAULT_CPU_KV_CACHE_SPACE_BYTES = 4 * GIB


@dataclass(frozen=True)
class ModelConfig:
    """Which model to run. `model=None` is the built-in default model, `"hash"` the deterministic test model.

    `generation_config` says where requests without their own SamplingParams take their defaults from: "auto"
    (the checkpoint's generation_config.json), "kvflow" or "vllm" (kvflow's own defaults), or a folder holding a
    generation_config.json. `max_logprobs` caps `SamplingParams.logprobs` (-1: no cap). `quantization` is None,
    "int8" (weight-only, quantized at load; `quantize_lm_head`: the LM head too) or "gguf" (`model` is a GGUF file;
    `tokenizer` then names the tokenizer folder).
    """

    model: str | None = None
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    device: str = "auto"
    generation_config: str = "auto"
    max_logprobs: int = 20
    quantization: str | None = None
    quantize_lm_head: bool = False
    # "generate" (sample tokens) or "pooling" (embed / classify / score; `pooling` then describes the model).
    runner: str = "generate"
    pooling: PoolingModelSpec | None = None

    def __post_init__(self) -> None:
        _require(
            (self.runner == "pooling") == (self.pooling is not None)
            and self.runner in ("generate", "pooling"),
            f"runner must be 'generate' or 'pooling' (with its model spec), got {self.runner!r}",
        )
        _require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _require(
            self.device == "auto" or self.device.split(":")[0] in ("cpu", "cuda"),
            f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}",
        )
        _require(
            self.max_model_len is None or self.max_model_len >= 2,
            f"max_model_len must be >= 2, got {self.max_model_len!r}",
        )
        _require(
            self.generation_config in GENERATION_CONFIG_SOURCES
            or os.path.isdir(self.generation_config),
            "generation_config must be 'auto' (the checkpoint's generation_config.json), 'kvflow' or 'vllm' "
            f"(kvflow's defaults) or a folder holding a generation_config.json, got {self.generation_config!r}",
        )
        _require(
            self.max_logprobs >= -1,
            f"max_logprobs must be >= 0 (or -1 for no cap), got {self.max_logprobs}",
        )

    @property
    def is_hash_model(self) -> bool:
        return self.model in ("hash", "hash-logits")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: `num_kv_blocks` blocks of `block_size` tokens.

    Without `num_kv_blocks` the cache is sized at startup (`kvflow.worker.worker.plan_kv_cache`): from
    `kv_cache_memory_bytes` if set, else on CPU `cpu_kv_cache_space_bytes` (KVFLOW_CPU_KVCACHE_SPACE, default
    4 GiB) capped at half the host's available memory, and on CUDA `gpu_memory_utilization` of the device's total
    memory minus what is already in use there (the model's weights included). The automatic size never exceeds
    what `max_num_seqs` sequences of `max_model_len` tokens need.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_space_bytes: int = DEFAULT_CPU_KV_CACHE_SPACE_BYTES

    def __post_init__(self) -> None:
        _require(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        _require(
            self.num_kv_blocks is None or self.num_kv_blocks >= 1,
            f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}",
        )
        _require(
            self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
            f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}",
        )
        _require(
            0 < self.gpu_memory_utilization <= 1,
            f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        _require(
            self.cpu_kv_cache_space_bytes > 0,
            f"cpu_kv_cache_space_bytes (KVFLOW_CPU_KVCACHE_SPACE) must be > 0, got "
            f"{self.cpu_kv_cache_space_bytes}",
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits and policy.

    `max_num_seqs` bounds the requests holding a worker slot; `max_num_batched_tokens` the tokens per step;
    `long_prefill_token_threshold > 0` caps one request's prefill chunk per step; without chunked prefill a
    prompt is scheduled whole or not at all (and nothing behind it jumps the queue).
    """

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: SchedulingPolicyName = "fcfs"
    async_scheduling: bool = False
    use_v2_model_runner: bool = True

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _require(
            self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}",
        )
        _require(self.max_model_len >= 2, f"max_model_len must be >= 2, got {self.max_model_len}")
        _require(
            self.long_prefill_token_threshold >= 0,
            f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}",
        )
        _require(
            self.policy in SCHEDULING_POLICIES,
            f"policy (scheduling_policy) must be one of {SCHEDULING_POLICIES}, got {self.policy!r}",
        )
        _require(
            self.enable_chunked_prefill or self.max_num_batched_tokens >= self.max_model_len,
            "without chunked prefill, max_num_batched_tokens "
            f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})",
        )


@dataclass(frozen=True)
class ParallelConfig:
    """How work is spread. `tensor_parallel_size` ranks each hold a shard of the model; their workers run under
    `distributed_executor_backend` ("uni": in-process, one rank only; "mp": worker processes; "ray": Ray actors;
    None: "uni" at one rank, "mp" above). `worker_thread` decides whether the in-process executor runs overlapped
    (async-scheduled) steps on its own thread: "auto" = only when the model is on CUDA, whose kernels leave the
    CPU free to schedule; on a CPU device the forward pass needs every core, so the step runs inline (same batch
    queue and outputs, no overlap)."""

    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    worker_thread: Literal["auto", "on", "off"] = "auto"

    def __post_init__(self) -> None:
        _require(
            self.tensor_parallel_size >= 1,
            f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}",
        )
        _require(
            self.distributed_executor_backend in (None, *EXECUTOR_BACKENDS),
            f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, "
            f"got {self.distributed_executor_backend!r}",
        )
        _require(
            self.distributed_executor_backend != "uni" or self.tensor_parallel_size == 1,
            "distributed_executor_backend 'uni' runs a single rank; tensor_parallel_size="
            f"{self.tensor_parallel_size} needs 'mp' or 'ray'",
        )
        _require(
            self.worker_thread in ("auto", "on", "off"),
            f"worker_thread must be 'auto', 'on' or 'off', got {self.worker_thread!r}",
        )


# `StructuredOutputsConfig.backend` values: the registered backends plus "auto".
STRUCTURED_OUTPUT_BACKENDS = ("auto", "xgrammar", "guidance")
# What a constraint may cost (`StructuredOutputsConfig`): the size limits, ints >= 1, then the compile timeout.
_COMPILE_SIZE_LIMITS = ("max_choices", "max_alternatives", "max_constraint_chars")
_COMPILE_LIMITS = (*_COMPILE_SIZE_LIMITS, "compile_timeout_s")
_STRUCTURED_OUTPUTS_KEYS = ("backend", "reasoning_parser", "enable_in_reasoning", *_COMPILE_LIMITS)


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """How the engine applies `SamplingParams.structured_outputs` constraints (vLLM's engine option).

    `backend` compiles them: "xgrammar" (the default, the `xgrammar` package), "guidance" (`llguidance`), or
    "auto": xgrammar, and guidance for a constraint xgrammar cannot compile or would not enforce exactly (JSON-schema
    keywords it ignores, `backend_xgrammar.UNENFORCED_KEYWORDS`: with "xgrammar" such a schema is refused, naming
    the keyword). `reasoning_parser` (a
    `REASONING_PARSERS` name, `--reasoning-parser`) makes a constraint start only once the output's reasoning has
    ended, so it shapes the answer and not the thought (`kvflow.structured_output.reasoning_end`), unless
    `enable_in_reasoning`, which constrains the reasoning too (from the first token, as without a parser).

    What a constraint may cost, checked before a request is queued (compiling against the vocabulary grows faster
    than linearly with them): `max_choices` choices, `max_alternatives` alternatives (`|`-separated, in a regex or
    grammar; enum values and anyOf / oneOf branches in a JSON schema), `max_constraint_chars` characters of
    constraint text (the regex, grammar, schema or choices). A request whose compile has not ended
    `compile_timeout_s` seconds after it arrived ends with finish_reason "error" (the API answers 400 naming the
    field); the compile's result, if it ever comes, stays cached. The one-time load of the vocabulary at the first
    constrained request does not count against anyone's timeout.
    """

    backend: str = "xgrammar"
    reasoning_parser: str | None = None
    enable_in_reasoning: bool = False
    max_choices: int = 4096
    max_alternatives: int = 4096
    max_constraint_chars: int = 65536
    compile_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        _require(
            self.backend in STRUCTURED_OUTPUT_BACKENDS,
            f"structured_outputs_config backend must be one of {STRUCTURED_OUTPUT_BACKENDS}, "
            f"got {self.backend!r}",
        )
        _require(
            self.reasoning_parser is None or self.reasoning_parser in REASONING_PARSERS,
            f"structured_outputs_config reasoning_parser: {REASONING_PARSERS.unknown_message(self.reasoning_parser)}",
        )
        _require(
            isinstance(self.enable_in_reasoning, bool),
            f"structured_outputs_config enable_in_reasoning must be true or false, got "
            f"{self.enable_in_reasoning!r}",
        )
        for name in _COMPILE_SIZE_LIMITS:
            value = getattr(self, name)
            _require(
                isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                f"structured_outputs_config {name} must be an int >= 1, got {value!r}",
            )
        timeout = self.compile_timeout_s
        _require(
            isinstance(timeout, int | float)
            and not isinstance(timeout, bool)
            and math.isfinite(timeout)
            and timeout > 0,
            f"structured_outputs_config compile_timeout_s must be a number of seconds > 0, got {timeout!r}",
        )

    @property
    def constrains_after_reasoning(self) -> bool:
        """Constraints start where the reasoning ends (a parser is set and `enable_in_reasoning` is off)."""
        return self.reasoning_parser is not None and not self.enable_in_reasoning

    @classmethod
    def from_option(cls, option: Mapping[str, object] | None) -> StructuredOutputsConfig:
        """From the engine option's dict (None: the defaults); an unknown key is a ValueError naming it."""
        option = dict(option or {})
        unknown = sorted(set(option) - set(_STRUCTURED_OUTPUTS_KEYS))
        _require(
            not unknown,
            f"structured_outputs_config has unknown keys {unknown}; it takes "
            + ", ".join(repr(key) for key in _STRUCTURED_OUTPUTS_KEYS),
        )
        backend = option.get("backend", cls.backend)
        _require(
            isinstance(backend, str),
            f"structured_outputs_config backend must be a string, got {backend!r}",
        )
        reasoning_parser = option.get("reasoning_parser")
        _require(
            reasoning_parser is None or isinstance(reasoning_parser, str),
            f"structured_outputs_config reasoning_parser must be a string, got {reasoning_parser!r}",
        )
        limits = {key: option[key] for key in _COMPILE_LIMITS if key in option}
        return cls(
            backend=backend,  # type: ignore[arg-type]
            reasoning_parser=reasoning_parser,  # type: ignore[arg-type]
            enable_in_reasoning=option.get("enable_in_reasoning", False),  # type: ignore[arg-type]
            **limits,  # type: ignore[arg-type]
        )


_SPECULATIVE_KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "model",
    "disable_by_batch_size",
)
_PROMPT_LOOKUP_KEYS = ("prompt_lookup_max", "prompt_lookup_min")
_DEFAULT_PROMPT_LOOKUP_MAX = 5
_DEFAULT_PROMPT_LOOKUP_MIN = 2


def _is_int(value: object) -> bool:
    """An int that is not a bool (`True` is a mistake, not 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_spec_method(method: object) -> None:
    """A `speculative_config` method must name a registered proposer (the registry imports nothing heavy)."""
    _require(
        isinstance(method, str) and method in SPEC_PROPOSERS,
        f"speculative_config method: {SPEC_PROPOSERS.unknown_message(method)}",
    )


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config` engine option): each decoding step verifies up to
    `num_speculative_tokens` drafted tokens per request and keeps the longest run the target model agrees with.

    `method` names a proposer in `kvflow.spec_decode.SPEC_PROPOSERS`: "ngram" drafts by prompt lookup (the tokens
    that followed the most recent earlier occurrence of the request's last n tokens, n from `prompt_lookup_max`
    down to `prompt_lookup_min`); "draft_model" drafts with the smaller model at `model` (same tokenizer).

    Invariants: `num_speculative_tokens >= 1`; `1 <= prompt_lookup_min <= prompt_lookup_max`; `model` is set
    exactly when `method` is "draft_model"; `disable_by_batch_size` is None or >= 1. Every violation is a
    ValueError naming the `speculative_config` key.

    `disable_by_batch_size` (vLLM's key) turns speculation off where it costs more than it gives: a step whose
    batch holds at least that many requests proposes no drafts (a large batch is compute-bound, and verifying
    drafts multiplies its work), so the next step verifies none; the worker logs each switch.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = _DEFAULT_PROMPT_LOOKUP_MAX
    prompt_lookup_min: int = _DEFAULT_PROMPT_LOOKUP_MIN
    model: str | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        _check_spec_method(self.method)
        _require(
            _is_int(self.num_speculative_tokens) and self.num_speculative_tokens >= 1,
            "speculative_config num_speculative_tokens must be an integer >= 1, got "
            f"{self.num_speculative_tokens!r}",
        )
        for key in _PROMPT_LOOKUP_KEYS:
            value = getattr(self, key)
            _require(
                _is_int(value) and value >= 1,
                f"speculative_config {key} must be an integer >= 1, got {value!r}",
            )
        _require(
            self.prompt_lookup_min <= self.prompt_lookup_max,
            f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
            f"prompt_lookup_max ({self.prompt_lookup_max})",
        )
        _require(
            self.model is None or isinstance(self.model, str),
            f"speculative_config model must be a path (a string), got {self.model!r}",
        )
        _require(
            self.disable_by_batch_size is None
            or (_is_int(self.disable_by_batch_size) and self.disable_by_batch_size >= 1),
            "speculative_config disable_by_batch_size must be an integer >= 1 (or null), got "
            f"{self.disable_by_batch_size!r}",
        )
        if self.method == "draft_model":
            _require(
                bool(self.model),
                "speculative_config method 'draft_model' needs 'model': the draft model's folder",
            )
        else:
            _require(
                self.model is None,
                f"speculative_config model is for method 'draft_model'; method {self.method!r} drafts "
                "without a model",
            )

    @classmethod
    def from_option(cls, option: Mapping[str, object] | None) -> SpeculativeConfig | None:
        """From the engine option's dict: None or {} is no speculation. `"model"` without `"method"` means
        "draft_model"; a prompt-lookup bound given alone moves the other's default so that min <= max (only
        `prompt_lookup_max: 1` gives min 1; only `prompt_lookup_min: 7` gives max 7). An unknown key, a missing
        one, or a key that does not apply to the method is a ValueError naming it."""
        if option is None:
            return None
        _require(
            isinstance(option, Mapping),
            f"speculative_config must be a JSON object (a dict), got {option!r}",
        )
        option = dict(option)
        if not option:
            return None
        unknown = sorted(set(option) - set(_SPECULATIVE_KEYS), key=str)
        _require(
            not unknown,
            f"speculative_config has unknown keys {unknown}; it takes "
            + ", ".join(repr(key) for key in _SPECULATIVE_KEYS),
        )
        method = option.get("method", "draft_model" if "model" in option else None)
        _require(
            method is not None,
            "speculative_config needs 'method' (one of "
            f"{', '.join(SPEC_PROPOSERS.names())}) or a draft 'model'",
        )
        _check_spec_method(method)
        _require(
            "num_speculative_tokens" in option,
            "speculative_config needs 'num_speculative_tokens': the drafted tokens per step",
        )
        if method != "ngram":
            given = [key for key in _PROMPT_LOOKUP_KEYS if key in option]
            _require(
                not given,
                f"speculative_config {', '.join(given)} applies to method 'ngram' only, not {method!r}",
            )
        lookup_max = option.get("prompt_lookup_max", _DEFAULT_PROMPT_LOOKUP_MAX)
        lookup_min = option.get("prompt_lookup_min", _DEFAULT_PROMPT_LOOKUP_MIN)
        if "prompt_lookup_max" not in option and _is_int(lookup_min):
            lookup_max = max(_DEFAULT_PROMPT_LOOKUP_MAX, lookup_min)  # type: ignore[call-overload]
        if "prompt_lookup_min" not in option and _is_int(lookup_max):
            lookup_min = min(_DEFAULT_PROMPT_LOOKUP_MIN, lookup_max)  # type: ignore[call-overload]
        return cls(
            method=method,  # type: ignore[arg-type]
            num_speculative_tokens=option["num_speculative_tokens"],  # type: ignore[arg-type]
            prompt_lookup_max=lookup_max,  # type: ignore[arg-type]
            prompt_lookup_min=lookup_min,  # type: ignore[arg-type]
            model=option.get("model"),  # type: ignore[arg-type]
            disable_by_batch_size=option.get("disable_by_batch_size"),  # type: ignore[arg-type]
        )


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (`enable_lora=True`): the worker holds `max_loras` adapter slots, the most distinct
    adapters one step may run (the scheduler admits no request whose adapter would make the running requests'
    adapters exceed it), and keeps up to `max_cpu_loras` loaded adapters in memory (least recently used evicted;
    default `max_loras`, never fewer). An adapter of rank above `max_lora_rank` is refused when it loads, naming
    its rank.
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        _require(self.max_loras >= 1, f"max_loras must be >= 1, got {self.max_loras}")
        _require(self.max_lora_rank >= 1, f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        _require(
            self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
            f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})",
        )

    @property
    def num_cpu_loras(self) -> int:
        """Loaded adapters kept in memory: `max_cpu_loras`, or `max_loras` when not set."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    structured_outputs_config: StructuredOutputsConfig = field(
        default_factory=StructuredOutputsConfig
    )
    speculative_config: SpeculativeConfig | None = None
    # Multi-LoRA serving; None: adapters are refused (a request naming one is an error).
    lora_config: LoRAConfig | None = None
