"""The attention backend interface: paged KV-cache writes and reads behind two calls per layer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from kvflow.batch import BatchInputs


class AttentionBackend(ABC):
    """Paged attention for one model: metadata built once per forward, then one `forward` call per layer.

    Invariants: one instance serves every layer of a model (all layers share head counts and head size); the
    per-layer KV cache has `kv_cache_shape(...)` and the model's dtype; `build_metadata` does all the per-step index
    and mask work, so `forward` only writes the step's K/V at `batch.slot_mapping` and attends. A backend that
    cannot apply `softcap` itself must still give soft-capped results (by another path) or refuse it at
    construction, never ignore it.
    """

    name: ClassVar[str]  # the name `ATTENTION_BACKENDS` registers it under

    def __init__(
        self,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        softcap: float | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) is not a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # Attention-logit soft-capping (Gemma 2): scores become `tanh(scale * q.k / softcap) * softcap` before
        # the mask and the softmax; None: no capping.
        self.softcap = softcap
        # The dtype the model's queries and KV cache come in (a backend may route rows by it); None: not known.
        self.dtype = dtype

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """One layer's cache: `[2 (key, value), num_blocks, block_size, num_kv_heads, head_dim]`."""
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    @abstractmethod
    def build_metadata(self, batch: BatchInputs, sliding_window: int | None = None) -> Any:
        """Everything the layers need to attend for this batch (built once per forward and window size)."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache_layer: torch.Tensor,
        metadata: Any,
    ) -> torch.Tensor:
        """Store `key`/`value` (`[num_tokens, num_kv_heads, head_dim]`) in the cache, then attend.

        `query` is `[num_tokens, num_heads, head_dim]`; returns `[num_tokens, num_heads, head_dim]`, where token `t`
        attends to its request's cached keys at positions `<= positions[t]` (and inside the sliding window).
        """
