"""Small helpers shared across layers. Importing this module does not import torch (`core/` stays torch-free):
the device helpers import it when called."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import numpy as np
    import torch

_Count = TypeVar("_Count", int, "np.ndarray")


def cdiv(numerator: _Count, denominator: int) -> _Count:
    """Ceiling division, for ints and (elementwise) integer numpy arrays: `cdiv(17, 16) == 2`."""
    return -(-numerator // denominator)


def resolve_device(device: str) -> torch.device:
    """'auto' is CUDA when present, else CPU; anything else is passed to `torch.device`."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Copy a host array to `device` (asynchronously where the device allows it).

    `np.ascontiguousarray` first: `torch.from_numpy` shares the array's memory and needs a contiguous one for a
    single copy. The copy is safe to overlap with later host work: a pageable source is staged before return.
    """
    import numpy as np
    import torch

    return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True)


def child_request_id(parent_request_id: str, index: int) -> str:
    """The core request id of sample `index` of a parallel-sampling (`n > 1`) request (vLLM's convention)."""
    return f"{index}_{parent_request_id}"
