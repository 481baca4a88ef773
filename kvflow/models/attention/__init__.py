"""Attention backends: the interface, the registry (`ATTENTION_BACKENDS`), the pure-PyTorch paged backend
(`"torch"`) and its C++ decode variant (`"cpu"`, imported on first lookup)."""

from __future__ import annotations

from kvflow.models.attention.base import AttentionBackend
from kvflow.models.attention.registry import (
    ATTENTION_BACKENDS,
    available_attention_backends,
    get_attention_backend,
    resolve_attention_backend,
)
from kvflow.models.attention.torch_paged import TorchPagedAttention, TorchPagedMetadata

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "TorchPagedAttention",
    "TorchPagedMetadata",
    "available_attention_backends",
    "get_attention_backend",
    "resolve_attention_backend",
]
