"""The worker: picks the device, loads the model, sizes and allocates the KV cache, executes steps."""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvflow.config import GIB
from kvflow.distributed.parallel_state import TensorParallelGroup
from kvflow.lora.model_manager import LoRAModelManager
from kvflow.model_info import resolve_model_info
from kvflow.models.registry import build_model
from kvflow.spec_decode import SPEC_PROPOSERS
from kvflow.utils import cdiv, resolve_device
from kvflow.worker.model_runner import ModelRunner
from kvflow.worker.persistent_batch import PersistentBatchModelRunner
from kvflow.worker.pooling_runner import PoolingModelRunner

if TYPE_CHECKING:
    from kvflow.config import CacheConfig, EngineConfig
    from kvflow.core.sched.output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
    from kvflow.lora.request import LoRARequest
    from kvflow.model_info import ModelInfo
    from kvflow.spec_decode.proposer import Proposer

logger = logging.getLogger(__name__)


def get_model_runner_class(use_v2_model_runner: bool) -> type[ModelRunner]:
    """The runner for a scheduler's protocol: the slot runner (default) or the persistent-batch runner."""
    return ModelRunner if use_v2_model_runner else PersistentBatchModelRunner


@dataclass(frozen=True)
class DeviceMemory:
    """A device's memory when the KV cache is sized: `total_bytes` (CUDA: the device's; CPU: MemTotal) and
    `free_bytes` (CUDA: free on the device, after this process loaded its model; CPU: MemAvailable)."""

    device_type: str
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class KVCachePlan:
    """The KV cache's size and the rule that decided it (for the startup log)."""

    num_blocks: int
    bytes_per_block: int
    rule: str

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def measure_device_memory(device: torch.device) -> DeviceMemory:
    """Total and free memory of `device` now (see `DeviceMemory`)."""
    if device.type == "cuda":
        free_bytes, total_bytes = torch.cuda.mem_get_info(device)
        return DeviceMemory("cuda", int(total_bytes), int(free_bytes))
    meminfo = _read_meminfo()
    page_size = os.sysconf("SC_PAGE_SIZE")
    total_bytes = meminfo.get("MemTotal", page_size * os.sysconf("SC_PHYS_PAGES"))
    free_bytes = meminfo.get("MemAvailable", page_size * os.sysconf("SC_AVPHYS_PAGES"))
    return DeviceMemory("cpu", total_bytes, free_bytes)


def _read_meminfo() -> dict[str, int]:
    """/proc/meminfo's byte counts by name (empty where there is no /proc)."""
    values: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                name, _, rest = line.partition(":")
                fields = rest.split()
                if fields and fields[0].isdigit():
                    values[name] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    except OSError:
        pass
    return values


def cpu_kv_cache_budget(cpu_kv_cache_space_bytes: int, free_bytes: int) -> int:
    """Bytes for an automatically sized CPU KV cache: the configured space (KVFLOW_CPU_KVCACHE_SPACE, 4 GiB by
    default), but at most half of the available memory, so the rest of the process and the host keep room."""
    return min(cpu_kv_cache_space_bytes, free_bytes // 2)


def cuda_kv_cache_budget(total_bytes: int, free_bytes: int, gpu_memory_utilization: float) -> int:
    """Bytes for an automatically sized CUDA KV cache, as vLLM counts them: the engine may use
    `gpu_memory_utilization` of the device's total memory; whatever is in use already (`total - free`: this
    process's weights, and any other process on the device) comes out of that share; the rest is the KV cache.
    Activations come out of the remaining `1 - gpu_memory_utilization` (kvflow does not profile a forward pass).
    Negative when the device is already fuller than the share allows."""
    in_use_bytes = total_bytes - free_bytes
    return int(total_bytes * gpu_memory_utilization) - in_use_bytes


def plan_kv_cache(
    engine_config: EngineConfig,
    bytes_per_block: int,
    memory: DeviceMemory,
    num_host_ranks: int = 1,
    blocks_per_sequence: int | None = None,
) -> KVCachePlan:
    """The KV cache's block count, by the first rule that applies:

    1. `num_kv_blocks`, as given;
    2. what `kv_cache_memory_bytes` buys;
    3. automatic: on CPU `cpu_kv_cache_budget`, on CUDA `cuda_kv_cache_budget`, capped at the blocks
       `max_num_seqs` sequences of `max_model_len` tokens need (more would only lengthen the prefix cache).

    A size the device cannot hold (more than its free memory), or one that holds no block, is a ValueError naming
    the option to change, raised before anything is allocated.

    Under tensor parallelism `bytes_per_block` is one rank's (its KV heads only) and the plan is one rank's: the
    explicit sizes apply per rank (as vLLM's are per GPU), and on CPU the automatic budget, which is the host's, is
    split between the `num_host_ranks` ranks sharing the host, so TP=N holds as many blocks as TP=1 would.

    `blocks_per_sequence` is what one `max_model_len` sequence holds (default: a block per `block_size` tokens; a
    model with sliding-window KV cache groups holds more, smaller blocks, see `KVCacheLayout.blocks_per_sequence`).
    """
    cache_config = engine_config.cache_config
    if cache_config.num_kv_blocks is not None:
        num_blocks = cache_config.num_kv_blocks
        _check_fits("num_kv_blocks", num_blocks, num_blocks * bytes_per_block, memory)
        return KVCachePlan(num_blocks, bytes_per_block, "num_kv_blocks")
    if cache_config.kv_cache_memory_bytes is not None:
        requested = cache_config.kv_cache_memory_bytes
        _check_fits("kv_cache_memory_bytes", requested, requested, memory)
        num_blocks = requested // bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={requested} holds no KV block ({bytes_per_block} bytes each)"
            )
        return KVCachePlan(num_blocks, bytes_per_block, f"kv_cache_memory_bytes={requested}")
    return _automatic_plan(
        engine_config, bytes_per_block, memory, num_host_ranks, blocks_per_sequence
    )


def _automatic_plan(
    engine_config: EngineConfig,
    bytes_per_block: int,
    memory: DeviceMemory,
    num_host_ranks: int,
    blocks_per_sequence: int | None = None,
) -> KVCachePlan:
    """The device's budget in blocks, or the blocks every slot needs at full length if that is fewer."""
    cache_config = engine_config.cache_config
    scheduler_config = engine_config.scheduler_config
    budget, rule = _automatic_budget(cache_config, memory)
    if memory.device_type == "cpu" and num_host_ranks > 1:
        budget //= num_host_ranks
        rule = f"{rule}, split between {num_host_ranks} ranks"
    budget_blocks = max(budget, 0) // bytes_per_block
    if budget_blocks < 1:
        raise ValueError(
            f"the KV cache budget ({rule}: {max(budget, 0)} bytes) holds no KV block ({bytes_per_block} "
            f"bytes each); {_raise_hint(memory.device_type)}"
        )
    if blocks_per_sequence is None:
        blocks_per_sequence = cdiv(scheduler_config.max_model_len, cache_config.block_size)
    blocks_for_all_slots = scheduler_config.max_num_seqs * blocks_per_sequence
    if blocks_for_all_slots <= budget_blocks:
        rule = (
            f"max_num_seqs={scheduler_config.max_num_seqs} x max_model_len="
            f"{scheduler_config.max_model_len}, under the cap of {rule}"
        )
        return KVCachePlan(blocks_for_all_slots, bytes_per_block, rule)
    return KVCachePlan(budget_blocks, bytes_per_block, rule)


def _automatic_budget(cache_config: CacheConfig, memory: DeviceMemory) -> tuple[int, str]:
    """(bytes, the rule in words) of the automatic size on `memory`'s device."""
    if memory.device_type == "cuda":
        utilization = cache_config.gpu_memory_utilization
        budget = cuda_kv_cache_budget(memory.total_bytes, memory.free_bytes, utilization)
        in_use = memory.total_bytes - memory.free_bytes
        return budget, (
            f"gpu_memory_utilization={utilization} of {_gib(memory.total_bytes)} minus "
            f"{_gib(in_use)} in use"
        )
    space = cache_config.cpu_kv_cache_space_bytes
    budget = cpu_kv_cache_budget(space, memory.free_bytes)
    if budget < space:
        return budget, f"half of the {_gib(memory.free_bytes)} available memory"
    return budget, f"the CPU KV cache space {_gib(space)} (KVFLOW_CPU_KVCACHE_SPACE)"


def _check_fits(option: str, value: int, num_bytes: int, memory: DeviceMemory) -> None:
    if num_bytes > memory.free_bytes:
        raise ValueError(
            f"{option}={value} asks for a {_gib(num_bytes)} KV cache, more than the "
            f"{_gib(memory.free_bytes)} free on {memory.device_type}; lower {option}"
        )


def _raise_hint(device_type: str) -> str:
    if device_type == "cuda":
        return "raise gpu_memory_utilization, free device memory, or set kv_cache_memory_bytes"
    return "free host memory, raise KVFLOW_CPU_KVCACHE_SPACE, or set kv_cache_memory_bytes"


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f} GiB"


def _log_kv_cache_plan(
    plan: KVCachePlan,
    engine_config: EngineConfig,
    device: torch.device,
    blocks_per_sequence: int | None = None,
) -> None:
    """Log the cache once at INFO; warn when it cannot hold `max_num_seqs` full-length sequences at once (each
    holding `blocks_per_sequence` blocks, by default one per `block_size` tokens)."""
    scheduler_config = engine_config.scheduler_config
    block_size = engine_config.cache_config.block_size
    num_tokens = plan.num_blocks * block_size
    max_model_len = scheduler_config.max_model_len
    if blocks_per_sequence is None:
        blocks_per_sequence = cdiv(max_model_len, block_size)
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB on %s, by %s); max concurrency %.2fx at "
        "max_model_len=%d",
        plan.num_blocks,
        block_size,
        num_tokens,
        plan.num_bytes / 2**20,
        device,
        plan.rule,
        plan.num_blocks / blocks_per_sequence,
        max_model_len,
    )
    num_full_length = plan.num_blocks // blocks_per_sequence
    if 1 <= num_full_length < scheduler_config.max_num_seqs:
        budget_knob = (
            "gpu_memory_utilization" if device.type == "cuda" else "KVFLOW_CPU_KVCACHE_SPACE"
        )
        logger.warning(
            "the KV cache holds %d sequences of max_model_len=%d tokens, fewer than max_num_seqs=%d: long "
            "requests will wait or be preempted; give the cache more memory (%s, kv_cache_memory_bytes or "
            "num_kv_blocks) or lower max_model_len / max_num_seqs",
            num_full_length,
            max_model_len,
            scheduler_config.max_num_seqs,
            budget_knob,
        )


def _spec_proposer(
    engine_config: EngineConfig, device: torch.device, vocab_size: int
) -> Proposer | None:
    """The speculative-decoding proposer the engine option names (`SPEC_PROPOSERS`), loaded onto `device` (a
    proposer with a model of its own builds it here), or None without one."""
    spec_config = engine_config.speculative_config
    if spec_config is None:
        return None
    proposer = SPEC_PROPOSERS.get(spec_config.method)(spec_config)
    proposer.load(engine_config, device, vocab_size)
    return proposer


class Worker:
    """One device's worker: a model plus the runner that holds its request slots and a KV cache of `num_kv_blocks`
    blocks. The runner speaks the scheduler's protocol (`SchedulerConfig.use_v2_model_runner`: the slot runner, else
    the persistent-batch runner). Its slot count is `max_num_seqs`, so the scheduler's admission bound matches it.

    Under tensor parallelism (`tp` of N ranks, joined by the executor before the worker is built) each rank has a
    Worker holding its shard of the model and a KV cache of its KV heads; every rank runs every step with the same
    `SchedulerOutput` and samples the same tokens from the same gathered logits, so their slots stay identical.
    On CUDA rank r uses `cuda:r` when the device option names no index."""

    def __init__(
        self,
        engine_config: EngineConfig,
        model_info: ModelInfo | None = None,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        model_config = engine_config.model_config
        scheduler_config = engine_config.scheduler_config
        block_size = engine_config.cache_config.block_size
        self.engine_config = engine_config
        self.tp = tp if tp is not None else TensorParallelGroup.single()
        self.rank = self.tp.rank
        self.device = resolve_device(model_config.device)
        if self.device.type == "cuda" and self.tp.size > 1 and self.device.index is None:
            self.device = torch.device("cuda", self.tp.rank % torch.cuda.device_count())
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)
        self.model_info = (
            model_info if model_info is not None else resolve_model_info(model_config.model)
        )
        self.model = build_model(model_config, self.model_info, self.device, self.tp)
        # LoRA (None: off): the model's adapter slots and the loaded-adapter cache.
        self.lora_manager = (
            None
            if engine_config.lora_config is None
            else LoRAModelManager(self.model, engine_config.lora_config)
        )
        spec_proposer = _spec_proposer(engine_config, self.device, self.model_info.vocab_size)
        draft_model = getattr(spec_proposer, "model", None)
        if draft_model is not None and hasattr(draft_model, "use_one_kv_group"):
            # A draft model reads the target's first KV cache group's block ids only.
            draft_model.use_one_kv_group()
        bytes_per_block = self.model.kv_cache_bytes_per_block(block_size)
        if spec_proposer is not None:
            # A draft model's KV cache has the target's blocks: each block costs both (n-gram: nothing more).
            bytes_per_block += spec_proposer.kv_cache_bytes_per_block(block_size)
        # What one full-length sequence holds with KV cache groups (None: a block per block_size tokens).
        layout = getattr(self.model, "kv_cache_layout", None)
        blocks_per_sequence = (
            None
            if layout is None or layout.group_windows == (None,)
            else layout.blocks_per_sequence(
                scheduler_config.max_model_len,
                block_size,
                scheduler_config.max_num_batched_tokens,
            )
        )
        if bytes_per_block == 0:
            # An encoder keeps no KV: its block ids only count tokens, every slot at full length.
            num_blocks = scheduler_config.max_num_seqs * cdiv(
                scheduler_config.max_model_len, block_size
            )
            self.kv_cache_plan = KVCachePlan(num_blocks, 0, "no KV cache (an encoder)")
        else:
            self.kv_cache_plan = plan_kv_cache(
                engine_config,
                bytes_per_block,
                measure_device_memory(self.device),
                self.tp.size,
                blocks_per_sequence=blocks_per_sequence,
            )
        _log_kv_cache_plan(self.kv_cache_plan, engine_config, self.device, blocks_per_sequence)
        self.num_kv_blocks = self.kv_cache_plan.num_blocks
        runner_class = get_model_runner_class(scheduler_config.use_v2_model_runner)
        runner_options: dict[str, Any] = {}
        if model_config.pooling is not None:
            runner_class = PoolingModelRunner
            runner_options["pooling"] = model_config.pooling
        self.model_runner = runner_class(
            self.model,
            max_num_reqs=scheduler_config.max_num_seqs,
            max_model_len=scheduler_config.max_model_len,
            block_size=block_size,
            num_blocks=self.num_kv_blocks,
            device=self.device,
            eos_token_id=self.model_info.eos_token_id,
            seed=model_config.seed,
            spec_proposer=spec_proposer,
            spec_disable_by_batch_size=(
                None
                if engine_config.speculative_config is None
                else engine_config.speculative_config.disable_by_batch_size
            ),
            lora_manager=self.lora_manager,
            **runner_options,
        )

    def update_weights(self, weights: str | Path | Mapping[str, torch.Tensor]) -> None:
        """Reload weights in place: a checkpoint folder (every parameter) or a state dict with Hugging Face names
        (just those tensors). The KV cache, slots and shapes stay; a bad update raises before touching the model
        only for unknown names or shapes found up front, so pass complete, checked tensors. A model without weights
        (the hash model) raises ValueError. A GGUF file reloads a GGUF model (its blocks; a quantized layer refuses
        float tensors, naming itself)."""
        from kvflow.models.loader import iterate_safetensors_weights
        from kvflow.models.quantization.gguf_file import GGUFCheckpoint, is_gguf_file

        if is_gguf_file(weights if isinstance(weights, str | Path) else None):
            self.model.load_weights(GGUFCheckpoint(weights).iterate_weights())  # type: ignore[arg-type]
        elif isinstance(weights, str | Path):
            select = getattr(self.model, "checkpoint_index", None) if self.tp.size > 1 else None
            if select is None:
                self.model.load_weights(iterate_safetensors_weights(Path(weights)))
            else:  # read only this rank's shards
                self.model.load_weights(
                    iterate_safetensors_weights(Path(weights), select), sliced=True
                )
        elif isinstance(weights, Mapping):
            self.model.load_weights(weights.items(), strict=False)
        else:
            raise ValueError(
                f"weights must be a checkpoint folder or a state dict, got {type(weights).__name__}"
            )

    def rank_info(self) -> dict[str, Any]:
        """This rank's place and shape, for `collective_rpc("rank_info")` (plain JSON values): `rank`,
        `tensor_parallel_size`, `pid`, `parent_pid`, `device`, `num_kv_blocks`, `kv_cache_shape`."""
        return {
            "rank": self.rank,
            "tensor_parallel_size": self.tp.size,
            "pid": os.getpid(),
            "parent_pid": os.getppid(),
            "device": str(self.device),
            "num_kv_blocks": self.num_kv_blocks,
            "kv_cache_shape": list(self.model_runner.kv_cache.shape),
        }

    # ------------------------------------------------------------------------------------------ LoRA
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter into this rank's cache (ValueError naming what is wrong for a bad one)."""
        return self._lora().add_adapter(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._lora().remove_adapter(lora_int_id)

    def pin_lora(self, lora_int_id: int) -> bool:
        return self._lora().pin_adapter(lora_int_id)

    def list_loras(self) -> set[int]:
        return self._lora().list_adapters()

    def _lora(self) -> LoRAModelManager:
        if self.lora_manager is None:
            raise ValueError("LoRA is not enabled (enable_lora=True, --enable-lora)")
        return self.lora_manager

    def kv_cache_group_windows(self) -> tuple[int | None, ...]:
        """The sliding window of each KV cache group of the model's layers (None: full attention), the layout the
        scheduler's KV cache manager must allocate by (`KVCacheLayout`); `(None,)` for a model without groups."""
        layout = getattr(self.model, "kv_cache_layout", None)
        return (None,) if layout is None else layout.group_windows

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one scheduled step (None: its sampling waits for `sample_tokens`)."""
        return self.model_runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: GrammarOutput) -> ModelRunnerOutput:
        """Sample the step whose forward pass ran last, under the step's grammar bitmask."""
        return self.model_runner.sample_tokens(grammar_output)

    def execute_method(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """The `collective_rpc` target: `self.<method>(*args, **kwargs)` for the name of a public method,
        `method(self, *args, **kwargs)` for a callable. Any other name (unknown, private, or an attribute that is
        not a method, like `model`) is an AttributeError naming it."""
        if isinstance(method, str):
            bound = None if method.startswith("_") else getattr(self, method, None)
            if not inspect.ismethod(bound):
                raise AttributeError(f"the worker has no public method {method!r}")
            return bound(*args, **(kwargs or {}))
        if not callable(method):
            raise TypeError(
                f"collective_rpc needs a method name or a callable, got {type(method).__name__}"
            )
        return method(self, *args, **(kwargs or {}))
