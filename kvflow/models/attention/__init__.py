"""Attention backends: the interface, the registry, the pure-PyTorch paged backend (`"torch"`) and its C++
decode variant (`"cpu"`, registered on first registry lookup)."""

from __future__ import annotations

from kvflow.models.attention.base import AttentionBackend
from kvflow.models.attention.registry import (
    available_attention_backends,
    get_attention_backend,
    register_attention_backend,
    resolve_attention_backend,
)
from kvflow.models.attention.torch_paged import TorchPagedAttention, TorchPagedMetadata

__all__ = [
    "AttentionBackend",
    "TorchPagedAttention",
    "TorchPagedMetadata",
    "available_attention_backends",
    "get_attention_backend",
    "register_attention_backend",
    "resolve_attention_backend",
]
