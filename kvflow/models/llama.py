"""Llama-family decoders over the paged KV cache: Llama (1-3), Mistral, Qwen2 and Qwen3 share this implementation.

Per forward: the attention metadata and the RoPE cos/sin are built once from the `BatchInputs`; each layer then runs
one fused QKV matmul, RoPE (after the per-head q/k RMSNorm for Qwen3), paged attention through the backend, the
output projection, and one fused gate/up matmul. In the last layer only the rows at `logits_indices` go past attention
(output projection, MLP, final norm, LM head), and only the logits are upcast to float32. Decode-only steps may
instead run each layer as one C++ call (`kvflow.models.fused_decode`, chosen once when the model is built);
checkpoint tensors load through `kvflow.models.loader` and each parameter's `weight_loader`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from kvflow import kernels
from kvflow.distributed.parallel_state import TensorParallelGroup, kv_head_partition, split_evenly
from kvflow.models.attention import AttentionBackend, get_attention_backend
from kvflow.models.fused_decode import FusedDecodeLayers
from kvflow.models.layers import (
    ColumnParallelLinear,
    LMHead,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabEmbedding,
    silu_and_mul,
)
from kvflow.models.loader import CheckpointModel

if TYPE_CHECKING:
    from kvflow.batch import BatchInputs
    from kvflow.models.hf_config import TransformerConfig
    from kvflow.models.quantization import QuantizationPlan


def tp_head_ranges(
    config: TransformerConfig, tp: TensorParallelGroup
) -> tuple[tuple[int, int], tuple[int, int]]:
    """`((first query head, query heads), (first KV head, KV heads))` rank `tp.rank` holds: the query heads divided
    evenly, the KV heads as `kv_head_partition` says (each rank's query heads attend to its KV heads only).
    Counts that do not divide are a ValueError naming the field."""
    heads = split_evenly(config.num_attention_heads, tp.size, tp.rank, "num_attention_heads")
    kv_heads = kv_head_partition(config.num_key_value_heads, tp.size, tp.rank)
    return heads, kv_heads


class LlamaAttention(nn.Module):
    """Self-attention with fused QKV: `qkv_proj` stacks q (num_heads), k and v (num_kv_heads) rows, in that order.

    Invariants: `q_norm`/`k_norm` exist exactly when the config has `qk_norm` (Qwen3), and are applied per head
    before RoPE; the backend is shared by every layer and holds no per-layer state. Under tensor parallelism
    `num_heads` / `num_kv_heads` are this rank's heads (`tp_head_ranges`): `qkv_proj` is column-parallel, `o_proj`
    row-parallel (one all-reduce).
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
            query = RotaryEmbedding.apply(self.q_norm(qkv[:, : self.num_heads]), cos, sin)
            key = RotaryEmbedding.apply(
                self.k_norm(qkv[:, self.num_heads : self.num_heads + self.num_kv_heads]), cos, sin
            )
        else:
            rotated = RotaryEmbedding.apply(qkv[:, : self.num_heads + self.num_kv_heads], cos, sin)
            query, key = rotated[:, : self.num_heads], rotated[:, self.num_heads :]
        attended = self.backend.forward(query, key, value, kv_cache_layer, metadata)
        if output_rows is not None:
            attended = attended.index_select(0, output_rows)
        return self.o_proj(attended.reshape(attended.shape[0], self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU MLP: `down(silu(gate(x)) * up(x))` with gate and up fused in `gate_up_proj` (gate rows first).
    Under tensor parallelism each rank holds a slice of the intermediate size: gate/up column-parallel, down
    row-parallel (one all-reduce)."""

    def __init__(
        self,
        config: TransformerConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallelGroup,
    ) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(
                f"unsupported hidden_act {config.hidden_act!r}; only 'silu' is implemented"
            )
        intermediate_range = split_evenly(
            config.intermediate_size, tp.size, tp.rank, "intermediate_size"
        )
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size,
            (intermediate_range,) * 2,
            bias=config.mlp_bias,
            dtype=dtype,
            device=device,
        )
        self.down_proj = RowParallelLinear(
            intermediate_range,
            config.hidden_size,
            bias=config.mlp_bias,
            tp=tp,
            dtype=dtype,
            device=device,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(hidden_states)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is carried separately and added inside the next norm.

    Invariants: `forward` returns `(block output, residual before that output)`; their sum is the block's
    transformers-equivalent hidden state. With `output_rows` (the last layer: only sampled tokens matter) every
    token still writes its K/V, but only those rows go through the output projection and the MLP.
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
        self.input_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device
        )
        self.self_attn = LlamaAttention(config, backend, dtype=dtype, device=device, tp=tp)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device
        )
        self.mlp = LlamaMLP(config, dtype=dtype, device=device, tp=tp)

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


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm (parameter names follow the checkpoint's `model.*`)."""

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
        self.embed_tokens = VocabEmbedding(
            config.vocab_size, config.hidden_size, dtype=dtype, device=device, tp=tp
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, backend, dtype=dtype, device=device, tp=tp)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)


class LlamaForCausalLM(CheckpointModel):
    """A Llama-family causal LM run by the model runner over a paged KV cache.

    Invariants: every parameter is in `dtype` on `device`; with tied embeddings `lm_head.weight` IS
    `model.embed_tokens.weight`. The KV cache is `[num_layers, *backend.kv_cache_shape(...)]`
    (K then V) in `dtype`; `forward` writes each scheduled token's K/V at `batch.slot_mapping` before any layer reads
    it, and returns float32 logits for `batch.logits_indices` only. Attention metadata and RoPE cos/sin are built once
    per forward (one metadata per distinct sliding window) and shared by all layers. It does not sample: the
    runner's `Sampler` turns its logits into tokens (`samples_own_tokens` is False).

    Tensor parallelism (`tp` of N ranks): each rank holds its query heads and KV heads (`tp_head_ranges`), its
    slice of the MLP and of the vocabulary; `num_kv_heads` and the KV cache are this rank's, and the logits are
    gathered, so every rank returns the whole vocabulary's logits. `checkpoint_index` says which part of each
    checkpoint tensor a rank loads, `load_weights` loads them (both from `CheckpointModel`). With `tp=None` (one
    rank) nothing is split and no collective runs.

    `fused_decode` is the decode-only fast path (`FusedDecodeLayers`), chosen once here, or None when this model's
    layers do not match it (under a `quantization` plan: when every layer's products are the plan's C++ kernels).
    """

    samples_own_tokens = False
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(
        self,
        config: TransformerConfig,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        attention_backend: str = "torch",
        tp: TensorParallelGroup | None = None,
        quantization: QuantizationPlan | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp if tp is not None else TensorParallelGroup.single()
        (_, num_heads), (_, num_kv_heads) = tp_head_ranges(config, self.tp)
        self.config = config
        self.vocab_size = config.vocab_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = config.head_dim
        self.attention_backend: AttentionBackend = get_attention_backend(attention_backend)(
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=config.head_dim,
            scale=config.head_dim**-0.5,
        )
        self.model = LlamaModel(
            config, self.attention_backend, dtype=dtype, device=self.device, tp=self.tp
        )
        self.lm_head = LMHead(
            config.vocab_size,
            config.hidden_size,
            dtype=dtype,
            device=self.device,
            tied_to=self.model.embed_tokens if config.tie_word_embeddings else None,
            tp=self.tp,
        )
        self.rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            device=self.device,
        )
        self._layer_windows = [
            config.layer_sliding_window(i) for i in range(config.num_hidden_layers)
        ]
        self.quantization = quantization
        if (
            quantization is not None
        ):  # before any weight loads: the layers take the plan's storage and kernels
            quantization.apply(self)
        if dtype is torch.bfloat16 and self.device.type == "cpu":
            kernels.bf16_gemm_kernel()  # a bad KVFLOW_BF16_GEMM fails here, at load, not in a forward pass
        self.fused_decode = FusedDecodeLayers.select(
            config,
            list(self.model.layers),
            self._layer_windows,
            self.attention_backend,
            dtype=dtype,
            device=self.device,
            tp=self.tp,
            quantized=quantization is not None,
        )

    # ------------------------------------------------------------------------------------------ KV cache
    def make_kv_cache(self, num_blocks: int, block_size: int) -> torch.Tensor:
        """A zeroed cache `[num_layers, *backend.kv_cache_shape(...)]` (torch backend: `[layers, 2, kv_heads,
        blocks, block_size, head_dim]`); zeros because padding that attention masks out must still be finite."""
        layer_shape = self.attention_backend.kv_cache_shape(
            num_blocks, block_size, self.num_kv_heads, self.head_dim
        )
        return torch.zeros((self.num_layers, *layer_shape), dtype=self.dtype, device=self.device)

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes one block takes across all layers, K and V."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * block_size * self.num_kv_heads * self.head_dim * element_size

    # ------------------------------------------------------------------------------------------ forward
    def forward(self, batch: BatchInputs, kv_cache: torch.Tensor) -> torch.Tensor:
        """Run the batch's tokens, fill their KV slots, and return float32 logits `[num_sampled, vocab_size]`."""
        metadata_by_window = {
            window: self.attention_backend.build_metadata(batch, window)
            for window in set(self._layer_windows)
        }
        max_position = int(batch.seq_lens.max()) - 1 if batch.num_reqs else 0
        cos, sin = self.rotary_emb.cos_sin(batch.positions, self.dtype, max_position)
        logits_indices = batch.logits_indices.to(torch.int64)
        hidden_states = self.model.embed_tokens(batch.input_ids)
        residual: torch.Tensor | None = None
        fused = None
        if self.fused_decode is not None:
            step = (hidden_states, cos, sin, kv_cache, metadata_by_window)
            fused = self.fused_decode.run(batch, logits_indices.numel(), *step)
        if fused is not None:
            hidden_states, residual = fused
        else:
            last_layer = self.num_layers - 1
            for layer_index, layer in enumerate(self.model.layers):
                hidden_states, residual = layer(
                    hidden_states,
                    residual,
                    cos,
                    sin,
                    kv_cache[layer_index],
                    metadata_by_window[self._layer_windows[layer_index]],
                    logits_indices if layer_index == last_layer else None,
                )
        if residual is None:  # no layers
            hidden_states = hidden_states.index_select(0, logits_indices)
        hidden_states, _ = self.model.norm.forward_with_residual(hidden_states, residual)
        return self.lm_head(hidden_states)
