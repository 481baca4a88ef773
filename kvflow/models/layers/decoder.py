"""The decoder stack families share: a pre-norm decoder layer around any attention and feed-forward block, and the
embedding / layers / final-norm trunk whose parameter names follow a checkpoint's `model.*`.

A family with the usual block (norm, attention, norm, feed-forward) builds `PreNormDecoderLayer` from its own
attention and feed-forward modules (a dense `GatedMLP`, or a mixture-of-experts block in the same place); a family
with another arrangement of norms writes its own layer with `PreNormDecoderLayer.forward`'s signature.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from kvflow.models.layers.norm import RMSNorm
from kvflow.models.layers.vocab import VocabEmbedding

if TYPE_CHECKING:
    from kvflow.distributed import TensorParallelGroup
    from kvflow.models.attention import AttentionBackend
    from kvflow.models.hf_config import TransformerConfig


class DecoderLayerFactory(Protocol):
    """Builds one decoder layer (a family's layer class is one): `layer(hidden_states, residual, cos, sin,
    kv_cache_layer, metadata, output_rows) -> (block output, residual)`, as `PreNormDecoderLayer.forward`."""

    def __call__(
        self,
        config: TransformerConfig,
        backend: AttentionBackend,
        *,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallelGroup,
    ) -> nn.Module: ...


class PreNormDecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is carried separately and added inside the next norm.

    Invariants: `forward` returns `(block output, residual before that output)`; their sum is the block's
    transformers-equivalent hidden state. With `output_rows` (the last layer: only sampled tokens matter) every
    token still writes its K/V, but only those rows go through the output projection and the feed-forward block.
    `self_attn` is called as `SelfAttention` is, `mlp` maps `[rows, hidden_size]` to the same shape.
    """

    def __init__(
        self,
        config: TransformerConfig,
        self_attn: nn.Module,
        mlp: nn.Module,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device
        )
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device
        )
        self.mlp = mlp

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache_layer: torch.Tensor,
        metadata: Any,
        output_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = self.input_layernorm.forward_with_residual(
            hidden_states, residual
        )
        hidden_states = self.self_attn(
            hidden_states, cos, sin, kv_cache_layer, metadata, output_rows
        )
        if output_rows is not None:
            residual = residual.index_select(0, output_rows)
        hidden_states, residual = self.post_attention_layernorm.forward_with_residual(
            hidden_states, residual
        )
        return self.mlp(hidden_states), residual


class DecoderModel(nn.Module):
    """Embedding, `num_hidden_layers` decoder layers (layer i made by `make_layers[i]`), and the final norm
    (parameter names follow the checkpoint's `model.*`: `embed_tokens`, `layers.<i>`, `norm`)."""

    def __init__(
        self,
        config: TransformerConfig,
        backend: AttentionBackend,
        make_layers: Sequence[DecoderLayerFactory],
        *,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallelGroup,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(
            config.vocab_size, config.hidden_size, dtype=dtype, device=device, tp=tp
        )
        if len(make_layers) != config.num_hidden_layers:
            raise ValueError(
                f"{len(make_layers)} layer factories for {config.num_hidden_layers} layers"
            )
        self.layers = nn.ModuleList(
            make_layer(config, backend, dtype=dtype, device=device, tp=tp)
            for make_layer in make_layers
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
