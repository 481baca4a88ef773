"""Gemma 2 over the paged KV cache (`Gemma2ForCausalLM`).

What differs from Llama, all matched to transformers' `modeling_gemma2`: embeddings scaled by `sqrt(hidden_size)`
(the factor rounded to the model dtype), Gemma's RMSNorm (`(1 + weight)`, float32 throughout) before *and* after
both the attention and the MLP (four norms per layer), a GELU-tanh gated MLP (`GatedMLP` with `hidden_act`
"gelu_pytorch_tanh"), the attention scale `query_pre_attn_scalar ** -0.5`, attention-logit soft-capping (the
backend's `softcap`), final-logit soft-capping, alternating sliding-window layers (the config's `layer_types`) and
tied embeddings. The shared `SelfAttention` and `GatedMLP` blocks and the `DecoderForCausalLM` shell are used as
they are; the "cpu" backend's C++ attention kernel soft-caps, so it attends every row of a Gemma 2 step, prompt
and decode (`CpuPagedAttention`); the Llama fused decode path never takes the model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kvflow.models.decoder_lm import DecoderForCausalLM
from kvflow.models.layers.mlp import GatedMLP
from kvflow.models.layers.norm import GemmaRMSNorm
from kvflow.models.layers.self_attention import SelfAttention

if TYPE_CHECKING:
    from kvflow.batch import BatchInputs
    from kvflow.distributed import TensorParallelGroup
    from kvflow.models.attention import AttentionBackend
    from kvflow.models.hf_config import TransformerConfig


class Gemma2DecoderLayer(nn.Module):
    """Norm, attention, norm, add; norm, MLP, norm, add (transformers' `Gemma2DecoderLayer`).

    Invariants: as `PreNormDecoderLayer.forward`, it returns `(block output, residual)` whose sum is the layer's
    hidden state, and with `output_rows` only those rows go past attention (every token still writes its K/V).
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

        def norm() -> GemmaRMSNorm:
            return GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)

        self.input_layernorm = norm()
        self.self_attn = SelfAttention(config, backend, dtype=dtype, device=device, tp=tp)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = GatedMLP(config, dtype=dtype, device=device, tp=tp)
        self.post_feedforward_layernorm = norm()

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
        if residual is not None:
            hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states), cos, sin, kv_cache_layer, metadata, output_rows
        )
        if output_rows is not None:
            residual = residual.index_select(0, output_rows)
        hidden_states = residual + self.post_attention_layernorm(hidden_states)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return self.post_feedforward_layernorm(mlp_out), hidden_states


class Gemma2ForCausalLM(DecoderForCausalLM):
    """A Gemma 2 causal LM (see `DecoderForCausalLM` for the cache, forward and tensor-parallel invariants).

    Invariants: the final norm is a `GemmaRMSNorm`; `forward`'s logits are soft-capped when the config has
    `final_logit_softcapping`; there is no fused decode path.
    """

    decoder_layer = Gemma2DecoderLayer

    def add_family_parts(self, config: TransformerConfig) -> None:
        self.model.norm = GemmaRMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype=self.dtype, device=self.device
        )
        # transformers multiplies by the factor as a tensor of the model's dtype.
        self.embed_scale = torch.tensor(
            config.hidden_size**0.5, dtype=self.dtype, device=self.device
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids) * self.embed_scale

    def forward(self, batch: BatchInputs, kv_cache: torch.Tensor) -> torch.Tensor:
        logits = super().forward(batch, kv_cache)
        cap = self.config.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap
