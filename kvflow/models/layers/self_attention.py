"""Self-attention over the paged KV cache with one fused QKV projection: the attention block decoder families share.

A family whose attention differs only in the config (q/k/v bias, output bias, per-head q/k norm, head sizes) uses
`SelfAttention` as it is; the paged reads and writes, masks and sliding windows are the backend's
(`kvflow.models.attention`), which one instance serves for every layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kvflow.distributed.parallel_state import TensorParallelGroup, kv_head_partition, split_evenly
from kvflow.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from kvflow.models.layers.norm import RMSNorm
from kvflow.models.layers.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from kvflow.models.attention import AttentionBackend
    from kvflow.models.hf_config import TransformerConfig


def tp_head_ranges(
    config: TransformerConfig, tp: TensorParallelGroup
) -> tuple[tuple[int, int], tuple[int, int]]:
    """`((first query head, query heads), (first KV head, KV heads))` rank `tp.rank` holds: the query heads divided
    evenly, the KV heads as `kv_head_partition` says (each rank's query heads attend to its KV heads only).
    Counts that do not divide are a ValueError naming the field."""
    heads = split_evenly(config.num_attention_heads, tp.size, tp.rank, "num_attention_heads")
    kv_heads = kv_head_partition(config.num_key_value_heads, tp.size, tp.rank)
    return heads, kv_heads


class SelfAttention(nn.Module):
    """Self-attention with fused QKV: `qkv_proj` stacks q (num_heads), k and v (num_kv_heads) rows, in that order.

    Invariants: `q_norm`/`k_norm` exist exactly when the config has `qk_norm`, and are applied per head before
    RoPE; the backend is shared by every layer and holds no per-layer state. Under tensor parallelism `num_heads` /
    `num_kv_heads` are this rank's heads (`tp_head_ranges`): `qkv_proj` is column-parallel, `o_proj` row-parallel
    (one all-reduce). Its checkpoint names are `q_proj`, `k_proj`, `v_proj` (packed into `qkv_proj`) and `o_proj`.
    """

    def __init__(
        self,
        config: TransformerConfig,
        backend: AttentionBackend,
        *,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallelGroup,
    ) -> None:
        super().__init__()
        (first_head, self.num_heads), (first_kv_head, self.num_kv_heads) = tp_head_ranges(
            config, tp
        )
        self.head_dim = config.head_dim
        q_range = (first_head * self.head_dim, self.num_heads * self.head_dim)
        kv_range = (first_kv_head * self.head_dim, self.num_kv_heads * self.head_dim)
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size,
            (q_range, kv_range, kv_range),
            bias=config.attention_bias,
            dtype=dtype,
            device=device,
        )
        self.o_proj = RowParallelLinear(
            q_range,
            config.hidden_size,
            bias=config.o_proj_bias,
            tp=tp,
            dtype=dtype,
            device=device,
        )
        self.q_norm = (
            RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype, device=device)
            if config.qk_norm
            else None
        )
        self.k_norm = (
            RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype, device=device)
            if config.qk_norm
            else None
        )
        self.backend = backend

    def forward(
        self,
        hidden_states: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache_layer: torch.Tensor,
        metadata: Any,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend for every token (all of them write K/V); with `output_rows`, project only those rows."""
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states).view(
            num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim
        )
        value = qkv[:, self.num_heads + self.num_kv_heads :]
        if self.q_norm is not None and self.k_norm is not None:
            query = RotaryEmbedding.apply(
                self.q_norm.forward_heads(qkv[:, : self.num_heads]), cos, sin
            )
            key = RotaryEmbedding.apply(
                self.k_norm.forward_heads(
                    qkv[:, self.num_heads : self.num_heads + self.num_kv_heads]
                ),
                cos,
                sin,
            )
        else:
            rotated = RotaryEmbedding.apply(qkv[:, : self.num_heads + self.num_kv_heads], cos, sin)
            query, key = rotated[:, : self.num_heads], rotated[:, self.num_heads :]
        attended = self.backend.forward(query, key, value, kv_cache_layer, metadata)
        if output_rows is not None:
            attended = attended.index_select(0, output_rows)
        return self.o_proj(attended.reshape(attended.shape[0], self.num_heads * self.head_dim))
