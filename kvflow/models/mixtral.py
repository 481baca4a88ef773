"""Mixtral (`MixtralForCausalLM`) over the paged KV cache.

A Mixtral layer is a Llama layer (pre-norm RMSNorm blocks, fused QKV without bias, RoPE, GQA, an optional sliding
window on every layer) whose dense MLP is a mixture of experts: `FusedMoE` with the softmax / top-k / renormalised
routing of transformers' `MixtralTopKRouter`. The checkpoint's `block_sparse_moe.gate` and per-expert
`block_sparse_moe.experts.<e>.w1/w2/w3` tensors load into the layer's `mlp` (its router and stacked expert
parameters) through their weight loaders (`checkpoint_target`). The Llama fused decode path never takes it
(`FusedDecodeLayers.select` declines a model with experts). Tensor parallelism splits every expert's intermediate
dimension across the ranks (`FusedMoE`); a rank reads only its rows of `w1` / `w3` and columns of `w2`
(`checkpoint_index`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvflow.models.decoder_lm import DecoderForCausalLM
from kvflow.models.layers.decoder import PreNormDecoderLayer
from kvflow.models.layers.fused_moe import FusedMoE, expert_checkpoint_index, softmax_topk
from kvflow.models.layers.self_attention import SelfAttention

if TYPE_CHECKING:
    import torch

    from kvflow.distributed import TensorParallelGroup
    from kvflow.models.attention import AttentionBackend
    from kvflow.models.hf_config import TransformerConfig

_MOE = ".block_sparse_moe."


class MixtralDecoderLayer(PreNormDecoderLayer):
    """The shared pre-norm block around `SelfAttention` and a `FusedMoE` (as `mlp`)."""

    def __init__(
        self,
        config: TransformerConfig,
        backend: AttentionBackend,
        *,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallelGroup,
    ) -> None:
        if config.hidden_act != "silu":
            raise ValueError(f"MixtralForCausalLM: hidden_act {config.hidden_act!r} (only 'silu')")
        super().__init__(
            config,
            SelfAttention(config, backend, dtype=dtype, device=device, tp=tp),
            FusedMoE(
                config.num_experts,
                config.num_experts_per_tok,
                config.hidden_size,
                config.intermediate_size,
                routing=softmax_topk,
                expert_names=("w1", "w3", "w2"),
                dtype=dtype,
                device=device,
                tp=tp,
            ),
            dtype=dtype,
            device=device,
        )


class MixtralForCausalLM(DecoderForCausalLM):
    """A Mixtral causal LM (see `DecoderForCausalLM` for the cache, forward and tensor-parallel invariants); no
    fused decode path."""

    decoder_layer = MixtralDecoderLayer

    def checkpoint_target(self, checkpoint_name: str) -> tuple[str, object] | None:
        """`...block_sparse_moe.gate.weight` -> the layer's `mlp.gate.weight`; `...block_sparse_moe.experts.<e>.
        w1|w3|w2.weight` -> its stacked expert parameter and (expert, part) shard; anything else: None."""
        if _MOE not in checkpoint_name:
            return None
        prefix, _, suffix = checkpoint_name.partition(_MOE)
        module_name = f"{prefix}.mlp"
        if suffix == "gate.weight":
            return f"{module_name}.gate.weight", None
        try:
            moe = self.get_submodule(module_name)
        except AttributeError:
            return None
        target = moe.checkpoint_target(suffix) if isinstance(moe, FusedMoE) else None
        return None if target is None else (f"{module_name}.{target[0]}", target[1])

    def checkpoint_index(self, checkpoint_name: str) -> tuple[slice, ...]:
        """This rank's part of a checkpoint tensor: the `FusedMoE`'s cut of an expert tensor, else the default."""
        if self.tp.size > 1 and _MOE in checkpoint_name:
            index = expert_checkpoint_index(self, checkpoint_name)
            if index is not None:
                return index
        return super().checkpoint_index(checkpoint_name)
