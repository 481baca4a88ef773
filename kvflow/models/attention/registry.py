"""Named attention backends, so a model can be built with `attention_backend="<name>"`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

    from kvflow.models.attention.base import AttentionBackend

BackendT = TypeVar("BackendT", bound="type[AttentionBackend]")

_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_attention_backend(name: str) -> Callable[[BackendT], BackendT]:
    """Class decorator: make the backend available as `get_attention_backend(name)`; a name is registered once."""

    def register(backend: BackendT) -> BackendT:
        existing = _BACKENDS.get(name)
        if existing is not None and existing is not backend:
            raise ValueError(
                f"attention backend {name!r} is already registered ({existing.__qualname__})"
            )
        backend.name = name
        _BACKENDS[name] = backend
        return backend

    return register


def get_attention_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered as `name`; an unknown name is a ValueError listing the known ones."""
    _register_builtin_backends()

    backend = _BACKENDS.get(name)
    if backend is None:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {', '.join(sorted(_BACKENDS))}"
        )
    return backend


def available_attention_backends() -> list[str]:
    """The registered backend names, sorted."""
    _register_builtin_backends()
    return sorted(_BACKENDS)


def _register_builtin_backends() -> None:
    import kvflow.models.attention.cpu_paged  # registers "cpu"
    import kvflow.models.attention.torch_paged  # noqa: F401  (registers "torch")


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """The backend to build for `name` on `device`: "auto" is "cpu" (the C++ decode kernel) on a CPU where the
    kernels are available, else "torch"; any other name is returned as given."""
    if name != "auto":
        return name
    from kvflow.kernels import cpu_kernels_available

    return "cpu" if device.type == "cpu" and cpu_kernels_available() else "torch"
