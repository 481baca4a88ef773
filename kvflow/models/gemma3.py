"""Gemma 3 text over the paged KV cache (`Gemma3ForCausalLM`, HF config `Gemma3TextConfig`).

Gemma 2's layer (four `(1 + w)` norms, GELU-tanh MLP, `query_pre_attn_scalar`, scaled embeddings, tied embeddings,
optional final-logit soft-capping; `Gemma2ForCausalLM` holds those pieces) plus what transformers'
`modeling_gemma3` adds: a `(1 + w)` RMSNorm on each query and key head before RoPE, and local (sliding-window) and
global layers chosen by the config's `layer_types`, each with its own rotary table: local layers plain RoPE at
`rope_local_base_freq`, global ones `rope_theta` with `rope_scaling`. Attention soft-capping is off by default
(`attn_logit_softcapping` None); the "cpu" backend's C++ kernel attends decode rows, and prompt rows of the
sliding-window layers (reading only the window), soft-capped or not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvflow.models.gemma2 import Gemma2DecoderLayer, Gemma2ForCausalLM
from kvflow.models.hf_config import SLIDING_ATTENTION
from kvflow.models.layers import RotaryEmbedding
from kvflow.models.layers.norm import GemmaRMSNorm

if TYPE_CHECKING:
    from kvflow.batch import BatchInputs
    from kvflow.distributed import TensorParallelGroup
    from kvflow.models.attention import AttentionBackend
    from kvflow.models.hf_config import TransformerConfig


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    """Gemma 2's layer whose attention normalises each query and key head with Gemma's `(1 + w)` RMSNorm
    (checkpoint names `self_attn.q_norm` / `self_attn.k_norm`, `head_dim` wide)."""

    def __init__(
        self,
        config: TransformerConfig,
        backend: AttentionBackend,
        *,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallelGroup,
    ) -> None:
        super().__init__(config, backend, dtype=dtype, device=device, tp=tp)
        self.self_attn.q_norm = GemmaRMSNorm(
            config.head_dim, config.rms_norm_eps, dtype=dtype, device=device
        )
        self.self_attn.k_norm = GemmaRMSNorm(
            config.head_dim, config.rms_norm_eps, dtype=dtype, device=device
        )


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """A Gemma 3 text causal LM (see `Gemma2ForCausalLM`).

    Invariants: `rotary_emb` is the global layers' table (`rope_theta`, `rope_scaling`), `local_rotary_emb` the
    sliding-window layers' (`sliding_rope_theta`, unscaled); each layer rotates with its type's table, both built
    once per forward.
    """

    decoder_layer = Gemma3DecoderLayer

    def add_family_parts(self, config: TransformerConfig) -> None:
        super().add_family_parts(config)
        self.local_rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.sliding_rope_theta
            if config.sliding_rope_theta is not None
            else config.rope_theta,
            None,
            device=self.device,
        )
        self.layer_is_local = [layer_type == SLIDING_ATTENTION for layer_type in config.layer_types]

    def layer_rotations(
        self, batch: BatchInputs, cos: torch.Tensor, sin: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Sliding-window layers rotate with the local table, the others with the global one."""
        max_position = int(batch.seq_lens.max()) - 1 if batch.num_reqs else 0
        local = self.local_rotary_emb.cos_sin(batch.positions, self.dtype, max_position)
        return [local if is_local else (cos, sin) for is_local in self.layer_is_local]
