"""Frozen engine configuration. Each field is declared once, here, and validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

SchedulingPolicyName = Literal["fcfs", "priority"]
# The allowed values of the choice options; `EngineArgs` offers the same lists on the command line.
DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULING_POLICIES: tuple[SchedulingPolicyName, ...] = ("fcfs", "priority")
EXECUTOR_BACKENDS = ("uni",)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class ModelConfig:
    """Which model to run. `model=None` is the built-in default model, `"hash"` the deterministic test model."""

    model: str | None = None
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    device: str = "auto"

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _require(
            self.device == "auto" or self.device.split(":")[0] in ("cpu", "cuda"),
            f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}",
        )
        _require(
            self.max_model_len is None or self.max_model_len >= 2,
            f"max_model_len must be >= 2, got {self.max_model_len!r}",
        )

    @property
    def is_hash_model(self) -> bool:
        return self.model == "hash"


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: `num_kv_blocks` blocks of `block_size` tokens.

    Without `num_kv_blocks` the cache is sized at startup from `kv_cache_memory_bytes`, or else from
    `kv_cache_memory_fraction` of the device's free memory (capped at what every slot at full length needs).
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_memory_fraction: float = 0.25

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
            0 < self.kv_cache_memory_fraction <= 1,
            f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}",
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
    """How work is spread. `worker_thread` decides whether overlapped (async-scheduled) steps run the worker on its
    own thread: "auto" = only when the model is on CUDA, whose kernels leave the CPU free to schedule; on a CPU
    device the forward pass needs every core, so the step runs inline (same batch queue and outputs, no overlap)."""

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
            self.worker_thread in ("auto", "on", "off"),
            f"worker_thread must be 'auto', 'on' or 'off', got {self.worker_thread!r}",
        )


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
