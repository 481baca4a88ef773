"""Where data-parallel engine cores run: which GPUs each core's process may see.

Light to import (torch only when no `CUDA_VISIBLE_DEVICES` lists the GPUs): both the data-parallel client and the
launcher of shared engines place cores with it.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvflow.config import EngineConfig

logger = logging.getLogger(__name__)


def core_devices(engine_config: EngineConfig, data_parallel_size: int) -> list[str | None]:
    """Each core's `CUDA_VISIBLE_DEVICES` (None: inherit this process's). On CUDA with the device left to kvflow
    ('auto' or 'cuda'), core i gets its own `tensor_parallel_size` GPUs, the i-th slice of those visible here, so
    its ranks see them as cuda:0, cuda:1, ... as vLLM places data-parallel ranks; with fewer GPUs than cores x
    ranks, or a device given by index, the cores share the devices (a warning says so)."""
    from kvflow.utils import resolve_device

    device = engine_config.model_config.device
    if resolve_device(device).type != "cuda":
        return [None] * data_parallel_size
    ranks = engine_config.parallel_config.tensor_parallel_size
    visible = visible_cuda_devices()
    if ":" in device or len(visible) < data_parallel_size * ranks:
        logger.warning(
            "%d data-parallel engine cores of %d rank(s) share the GPUs (device %r, %d visible): give each core "
            "its own GPUs with device='cuda' and at least %d visible GPUs",
            data_parallel_size,
            ranks,
            device,
            len(visible),
            data_parallel_size * ranks,
        )
        return [None] * data_parallel_size
    return split_devices(visible, data_parallel_size, ranks)


def split_devices(visible: list[str], data_parallel_size: int, ranks: int) -> list[str | None]:
    """Core i's devices: `visible[i * ranks : (i + 1) * ranks]`, comma-separated (needs enough of them)."""
    if len(visible) < data_parallel_size * ranks:
        raise ValueError(
            f"{data_parallel_size} engine cores x {ranks} ranks need {data_parallel_size * ranks} GPUs, "
            f"{len(visible)} are visible"
        )
    return [
        ",".join(visible[index * ranks : (index + 1) * ranks])
        for index in range(data_parallel_size)
    ]


def visible_cuda_devices() -> list[str]:
    """The GPUs this process may use: `CUDA_VISIBLE_DEVICES` as given (ids or UUIDs), else 0 .. count - 1."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [each.strip() for each in listed.split(",") if each.strip()]
    import torch

    return [str(index) for index in range(torch.cuda.device_count())]
