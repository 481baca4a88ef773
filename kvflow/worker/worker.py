"""The worker: picks the device, loads the model, sizes and allocates the KV cache, executes steps."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvflow.model_info import resolve_model_info
from kvflow.models.registry import build_model
from kvflow.utils import cdiv, resolve_device
from kvflow.worker.model_runner import ModelRunner
from kvflow.worker.persistent_batch import PersistentBatchModelRunner

if TYPE_CHECKING:
    from kvflow.config import EngineConfig
    from kvflow.core.sched.output import ModelRunnerOutput, SchedulerOutput
    from kvflow.model_info import ModelInfo

logger = logging.getLogger(__name__)


def get_model_runner_class(use_v2_model_runner: bool) -> type[ModelRunner]:
    """The runner for a scheduler's protocol: the slot runner (default) or the persistent-batch runner."""
    return ModelRunner if use_v2_model_runner else PersistentBatchModelRunner


def available_memory_bytes(device: torch.device) -> int:
    """Free memory on the device: CUDA's free bytes, or the host's MemAvailable."""
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        return int(free_bytes)
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def determine_num_kv_blocks(
    engine_config: EngineConfig, bytes_per_block: int, device: torch.device
) -> int:
    """`num_kv_blocks` if set; else what `kv_cache_memory_bytes` buys; else `kv_cache_memory_fraction` of free
    memory, capped at the blocks every slot needs at full length (more would only lengthen the prefix cache)."""
    cache_config = engine_config.cache_config
    if cache_config.num_kv_blocks is not None:
        return cache_config.num_kv_blocks
    if cache_config.kv_cache_memory_bytes is not None:
        num_blocks = cache_config.kv_cache_memory_bytes // bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={cache_config.kv_cache_memory_bytes} holds no KV block "
                f"({bytes_per_block} bytes each)"
            )
        return num_blocks
    scheduler_config = engine_config.scheduler_config
    blocks_for_all_slots = scheduler_config.max_num_seqs * cdiv(
        scheduler_config.max_model_len, cache_config.block_size
    )
    budget = int(available_memory_bytes(device) * cache_config.kv_cache_memory_fraction)
    num_blocks = min(blocks_for_all_slots, budget // bytes_per_block)
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory_fraction={cache_config.kv_cache_memory_fraction} of free memory "
            f"({budget} bytes) holds no KV block ({bytes_per_block} bytes each)"
        )
    return num_blocks


class Worker:
    """One device's worker: a model plus the runner that holds its request slots and a KV cache of `num_kv_blocks`
    blocks. The runner speaks the scheduler's protocol (`SchedulerConfig.use_v2_model_runner`: the slot runner, else
    the persistent-batch runner). Its slot count is `max_num_seqs`, so the scheduler's admission bound matches it."""

    def __init__(self, engine_config: EngineConfig, model_info: ModelInfo | None = None) -> None:
        model_config = engine_config.model_config
        scheduler_config = engine_config.scheduler_config
        block_size = engine_config.cache_config.block_size
        self.engine_config = engine_config
        self.device = resolve_device(model_config.device)
        self.model_info = (
            model_info if model_info is not None else resolve_model_info(model_config.model)
        )
        self.model = build_model(model_config, self.model_info, self.device)
        bytes_per_block = self.model.kv_cache_bytes_per_block(block_size)
        self.num_kv_blocks = determine_num_kv_blocks(engine_config, bytes_per_block, self.device)
        runner_class = get_model_runner_class(scheduler_config.use_v2_model_runner)
        self.model_runner = runner_class(
            self.model,
            max_num_reqs=scheduler_config.max_num_seqs,
            max_model_len=scheduler_config.max_model_len,
            block_size=block_size,
            num_blocks=self.num_kv_blocks,
            device=self.device,
            eos_token_id=self.model_info.eos_token_id,
            seed=model_config.seed,
        )
        num_tokens = self.num_kv_blocks * block_size
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB on %s); max concurrency %.2fx at "
            "max_model_len=%d",
            self.num_kv_blocks,
            block_size,
            num_tokens,
            self.num_kv_blocks * bytes_per_block / 2**20,
            self.device,
            num_tokens / scheduler_config.max_model_len,
            scheduler_config.max_model_len,
        )

    def update_weights(self, weights: str | Path | Mapping[str, torch.Tensor]) -> None:
        """Reload weights in place: a checkpoint folder (every parameter) or a state dict with Hugging Face names
        (just those tensors). The KV cache, slots and shapes stay; a bad update raises before touching the model
        only for unknown names or shapes found up front, so pass complete, checked tensors. A model without weights
        (the hash model) raises ValueError."""
        from kvflow.models.loader import iterate_safetensors_weights

        if isinstance(weights, str | Path):
            self.model.load_weights(iterate_safetensors_weights(Path(weights)))
        elif isinstance(weights, Mapping):
            self.model.load_weights(weights.items(), strict=False)
        else:
            raise ValueError(
                f"weights must be a checkpoint folder or a state dict, got {type(weights).__name__}"
            )

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step."""
        return self.model_runner.execute_model(scheduler_output)
