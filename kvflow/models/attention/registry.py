"""Named attention backends, so a model can be built with `attention_backend="<name>"`: one `LazyRegistry` table.

Invariants: this module imports no backend (the table holds import paths, resolved on lookup), so the backends never
import it back; each registered class's `name` is the name it is registered under.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvflow.registry import LazyRegistry

if TYPE_CHECKING:
    import torch

    from kvflow.models.attention.base import AttentionBackend

ATTENTION_BACKENDS: LazyRegistry[type[AttentionBackend]] = LazyRegistry(
    "attention backend",
    {
        "torch": "kvflow.models.attention.torch_paged:TorchPagedAttention",
        "cpu": "kvflow.models.attention.cpu_paged:CpuPagedAttention",
    },
)


def get_attention_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered as `name`; an unknown name is a ValueError listing the known ones."""
    return ATTENTION_BACKENDS.get(name)


def available_attention_backends() -> list[str]:
    """The registered backend names, sorted."""
    return sorted(ATTENTION_BACKENDS.names())


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """The backend to build for `name` on `device`: "auto" is "cpu" (the C++ decode kernel) on a CPU where the
    kernels are available, else "torch"; any other name is returned as given."""
    if name != "auto":
        return name
    from kvflow.kernels import cpu_kernels_available

    return "cpu" if device.type == "cpu" and cpu_kernels_available() else "torch"
