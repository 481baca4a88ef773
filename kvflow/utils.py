"""Small helpers shared across layers. Importing this module does not import torch (`core/` stays torch-free):
the device helpers import it when called."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import numpy as np
    import torch

_Count = TypeVar("_Count", int, "np.ndarray")


def cdiv(numerator: _Count, denominator: int) -> _Count:
    """Ceiling division, for ints and (elementwise) integer numpy arrays: `cdiv(17, 16) == 2`."""
    return -(-numerator // denominator)


def resolve_device(device: str) -> torch.device:
    """The torch device for a `device` option: 'auto' is CUDA when present, else CPU; 'cpu'; 'cuda' or 'cuda:N'.

    Raises ValueError naming `device` for anything else, and for a CUDA device this process cannot use (a
    CPU-only PyTorch build, no visible GPU, or an index past the last GPU), before any model is loaded.
    """
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if kind == "cuda":
        _check_cuda_device(device, int(index) if index else 0)
    return torch.device(device)


def _check_cuda_device(device: str, index: int) -> None:
    import torch

    if not torch.backends.cuda.is_built():
        raise ValueError(
            f"device {device!r} requested but this PyTorch build ({torch.__version__}) has no CUDA support; "
            "use device='cpu' (or 'auto'), or install a CUDA build of PyTorch"
        )
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if num_gpus == 0:
        raise ValueError(
            f"device {device!r} requested but no CUDA GPU is visible (check the driver and "
            "CUDA_VISIBLE_DEVICES); use device='cpu' (or 'auto')"
        )
    if index >= num_gpus:
        raise ValueError(
            f"device {device!r} requested but only {num_gpus} CUDA GPU(s) are visible (cuda:0.."
            f"cuda:{num_gpus - 1})"
        )


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Copy a host array to `device` (asynchronously where the device allows it).

    `np.ascontiguousarray` first: `torch.from_numpy` shares the array's memory and needs a contiguous one for a
    single copy. The copy is safe to overlap with later host work: a pageable source is staged before return.
    """
    import numpy as np
    import torch

    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cpu":  # no copy: `.to` would return this same tensor
        return tensor
    return tensor.to(device, non_blocking=True)


def child_request_id(parent_request_id: str, index: int) -> str:
    """The core request id of sample `index` of a parallel-sampling (`n > 1`) request (vLLM's convention)."""
    return f"{index}_{parent_request_id}"


def short_repr(value: object, limit: int = 60) -> str:
    """A value's repr for an error message, cut to `limit` characters: a hostile value may be huge (an int of
    thousands of digits has no repr at all, only a bit length)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an int of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def kvflow_cache_dir() -> Path:
    """kvflow's cache root: `$KVFLOW_CACHE_DIR` when set, else `~/.cache/kvflow` (not created here)."""
    root = os.environ.get("KVFLOW_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "kvflow"


OPENMP_WAIT_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def openmp_threads_sleep_while_waiting() -> bool:
    """Make the OpenMP threads of torch loaded from here on (in this process and the processes it starts) sleep
    when they wait, instead of spinning (`OMP_WAIT_POLICY=PASSIVE`), unless the environment already says how they
    wait (`OPENMP_WAIT_ENV`); True if it did. For a server: the API process shares the cores with the engine's
    OpenMP team, and a spinning team stalls at every barrier where one of its threads lost its core to it (on 2
    cores a client flooding the API process tripled the engine's p99 latency; sleeping workers are woken on a free
    core). The price on an otherwise idle machine is a wake-up per parallel region (benchmarks/RESULTS.md,
    "Constraint compiles beside a hostile client"). libgomp reads the variable once, when torch loads it."""
    if any(name in os.environ for name in OPENMP_WAIT_ENV):
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True
