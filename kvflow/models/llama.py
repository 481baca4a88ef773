"""Llama-family decoders over the paged KV cache: Llama (1-3), Mistral, Qwen2 and Qwen3 share this implementation.

Each layer is the shared pre-norm block (`kvflow.models.layers.decoder`) around one fused QKV matmul, RoPE (after the
per-head q/k RMSNorm for Qwen3), paged attention through the backend and the output projection
(`kvflow.models.layers.self_attention`), then one fused gate/up matmul (`kvflow.models.layers.mlp`); the differences
between the four architectures come from the parsed config. The causal-LM shell (KV cache, metadata, RoPE, final
norm, LM head) is `DecoderForCausalLM`'s. Decode-only steps may instead run each layer as one C++ call
(`kvflow.models.fused_decode`, chosen once when the model is built).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvflow.models.decoder_lm import DecoderForCausalLM
from kvflow.models.fused_decode import FusedDecodeLayers
from kvflow.models.layers.decoder import PreNormDecoderLayer
from kvflow.models.layers.linear import Linear
from kvflow.models.layers.mlp import GatedMLP
from kvflow.models.layers.self_attention import SelfAttention

if TYPE_CHECKING:
    from kvflow.batch import BatchInputs
    from kvflow.distributed import TensorParallelGroup
    from kvflow.models.attention import AttentionBackend
    from kvflow.models.hf_config import TransformerConfig


class LlamaDecoderLayer(PreNormDecoderLayer):
    """The shared pre-norm block around `SelfAttention` and a dense `GatedMLP` (the layout `fused_decode` runs)."""

    def __init__(
        self,
        config: TransformerConfig,
        backend: AttentionBackend,
        *,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallelGroup,
    ) -> None:
        super().__init__(
            config,
            SelfAttention(config, backend, dtype=dtype, device=device, tp=tp),
            GatedMLP(config, dtype=dtype, device=device, tp=tp),
            dtype=dtype,
            device=device,
        )


class LlamaForCausalLM(DecoderForCausalLM):
    """A Llama-family causal LM (see `DecoderForCausalLM` for the cache, forward and tensor-parallel invariants).

    `fused_decode` is the decode-only fast path (`FusedDecodeLayers`), chosen once here, or None when this model's
    layers do not match it (under a `quantization` plan: when every layer's products are the plan's C++ kernels);
    a step it declines runs the per-op layers.
    """

    decoder_layer = LlamaDecoderLayer

    def add_family_parts(self, config: TransformerConfig) -> None:
        self.fused_decode = FusedDecodeLayers.select(
            config,
            list(self.model.layers),
            self.layer_windows,
            self.attention_backend,
            dtype=self.dtype,
            device=self.device,
            tp=self.tp,
            quantized=self.quantization is not None,
        )
        if (
            self.fused_decode is not None
            and self.fused_decode.is_quantized
            and self.dtype is torch.float32
        ):
            # The final norm on the C++ RMSNorm, as the fused layers' norms: 7 torch ops less a step (~0.14 ms
            # on caches the weight stream has emptied). Prefill and decode share it, so every step agrees; a
            # quantized model's outputs never were torch's float32 RMSNorm bit for bit anyway.
            self.model.norm.float32_kernel = True

    def run_layers(
        self,
        batch: BatchInputs,
        hidden_states: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata_by_window: dict[int | None, Any],
        logits_indices: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fused decode path when it takes the step, else the per-op layers."""
        if self.fused_decode is not None:
            step = (hidden_states, cos, sin, kv_cache, metadata_by_window)
            fused = self.fused_decode.run(batch, logits_indices.numel(), *step)
            if fused is not None:
                return fused
        return super().run_layers(
            batch, hidden_states, cos, sin, kv_cache, metadata_by_window, logits_indices
        )


class LlamaForSequenceClassification(LlamaForCausalLM):
    """A Llama-family decoder with a classification head (`Qwen2ForSequenceClassification`,
    `Qwen3ForSequenceClassification`, `LlamaForSequenceClassification`): `score`, a `[num_labels, hidden]` linear
    layer without bias, on the pooled (by default the last token's) final hidden state. Run by the pooling runner
    only: it has no LM head, so `forward` (logits over a vocabulary) is not available.

    Invariants: `classify` maps `[n, hidden]` pooled states to float32 logits `[n, num_labels]`, row by row.
    """

    def add_family_parts(self, config: TransformerConfig) -> None:
        super().add_family_parts(config)
        del self.lm_head  # the classifier's checkpoint has none, and no step needs one
        self.lm_head = None
        self.num_labels = config.num_labels
        self.score = Linear(
            config.hidden_size, config.num_labels, bias=False, dtype=self.dtype, device=self.device
        )

    def forward(self, batch: BatchInputs, kv_cache: torch.Tensor) -> torch.Tensor:
        raise ValueError(
            f"{self.config.architecture} is a classifier: it runs with runner='pooling' only"
        )

    def classify(self, pooled_states: torch.Tensor) -> torch.Tensor:
        return self.score(pooled_states.to(self.dtype)).float()
