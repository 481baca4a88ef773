"""Named attention backends, so a model can be built with `attention_backend="<name>"`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
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
    import kvflow.models.attention.torch_paged  # noqa: F401  (registers the built-in backend)

    backend = _BACKENDS.get(name)
    if backend is None:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {', '.join(sorted(_BACKENDS))}"
        )
    return backend


def available_attention_backends() -> list[str]:
    """The registered backend names, sorted."""
    import kvflow.models.attention.torch_paged  # noqa: F401

    return sorted(_BACKENDS)
