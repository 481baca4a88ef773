"""Qwen2-MoE (`Qwen2MoeForCausalLM`) and Qwen3-MoE (`Qwen3MoeForCausalLM`) over the paged KV cache.

Both are Qwen2 / Qwen3 layers (pre-norm RMSNorm blocks, fused QKV, RoPE, GQA; Qwen2-MoE with q/k/v bias, Qwen3-MoE
with a per-head q/k RMSNorm) whose feed-forward block is, on the layers `TransformerConfig.layer_has_experts`
picks (every `decoder_sparse_step`-th layer not in `mlp_only_layers`), a mixture of experts: `FusedMoE` with
transformers' softmax / top-k routing, renormalised only with `norm_topk_prob`. Qwen2-MoE adds a shared expert run
on every token (`SharedExpertMoE`). The other layers are dense Llama layers (`GatedMLP` of `intermediate_size`).
The differences between the two architectures come from the parsed config: `QwenMoeForCausalLM` runs both, each
registered under its own subclass.

Checkpoint names: the router `mlp.gate.weight`, the shared expert `mlp.shared_expert.gate_proj|up_proj|down_proj`
and its gate `mlp.shared_expert_gate.weight` load as they are named (gate/up packed as for `GatedMLP`); the
per-expert `mlp.experts.<e>.gate_proj|up_proj|down_proj.weight` tensors load into the stacked expert parameters
(`checkpoint_target`). The Llama fused decode path never takes these models (`FusedDecodeLayers.select` declines a
config with experts).

Tensor parallelism: every routed expert's intermediate dimension is split across the ranks as `FusedMoE` splits
Mixtral's (a rank reads only its rows of `gate_proj` / `up_proj` and columns of `down_proj`, `checkpoint_index`), the
router is replicated; Qwen2-MoE's shared expert is split as a tensor-parallel `GatedMLP` and its sigmoid gate is
replicated. A block all-reduces once: the routed partial sum plus the gated shared-expert partial sum (the gate is a
per-token scalar every rank computes whole, so scaling a partial sum by it is exact). Dense layers are the usual
tensor-parallel `GatedMLP`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.models.decoder_lm import DecoderForCausalLM
from kvflow.models.layers.decoder import PreNormDecoderLayer
from kvflow.models.layers.fused_moe import FusedMoE, expert_checkpoint_index, softmax_topk
from kvflow.models.layers.mlp import GatedMLP
from kvflow.models.layers.self_attention import SelfAttention
from kvflow.models.llama import LlamaDecoderLayer

if TYPE_CHECKING:
    from kvflow.distributed import TensorParallelGroup
    from kvflow.models.attention import AttentionBackend
    from kvflow.models.hf_config import TransformerConfig
    from kvflow.models.layers.decoder import DecoderLayerFactory

_MLP = ".mlp."
_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


class SharedExpertMoE(FusedMoE):
    """`FusedMoE`'s routed experts plus Qwen2-MoE's shared expert (transformers' `Qwen2MoeSparseMoeBlock`).

    Invariants: `shared_expert` is a SwiGLU `GatedMLP` `shared_expert_intermediate_size` wide that every token runs;
    `shared_expert_gate.weight` is `[1, hidden_size]`; a token's output is its routed output plus
    `sigmoid(shared_expert_gate(x)) * shared_expert(x)`. Under tensor parallelism each rank holds its slice of the
    routed experts' and the shared expert's intermediate dimensions and the whole router and gate; `forward` sums
    both partial outputs on the rank and all-reduces once.
    """

    def __init__(
        self,
        config: TransformerConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallelGroup,
    ) -> None:
        super().__init__(
            config.num_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.moe_intermediate_size,
            routing=_routing(config),
            expert_names=_EXPERT_NAMES,
            dtype=dtype,
            device=device,
            tp=tp,
        )
        shared_config = dataclasses.replace(
            config, intermediate_size=config.shared_expert_intermediate_size, mlp_bias=False
        )
        self.shared_expert = GatedMLP(shared_config, dtype=dtype, device=device, tp=tp)
        self.shared_expert_gate = nn.Module()
        self.shared_expert_gate.weight = nn.Parameter(
            torch.empty(1, config.hidden_size, dtype=dtype, device=device), requires_grad=False
        )

    def partial(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """This rank's part of the block's output, before `FusedMoE.forward`'s all-reduce: its routed experts'
        weighted sum plus the gate times its part of the shared expert (the whole output with one rank)."""
        routed = super().partial(hidden_states)
        gate = torch.sigmoid(F.linear(hidden_states, self.shared_expert_gate.weight))
        mlp = self.shared_expert
        # `GatedMLP` without its down projection's all-reduce (the shared expert has no bias to add once).
        shared = mlp.down_proj.matmul(mlp.activation(mlp.gate_up_proj(hidden_states)), None)
        return routed + gate * shared


def _routing(config: TransformerConfig) -> functools.partial[tuple[torch.Tensor, torch.Tensor]]:
    """Softmax top-k, renormalised only with `norm_topk_prob` (transformers' `Qwen2MoeTopKRouter`)."""
    return functools.partial(softmax_topk, renormalize=config.norm_topk_prob)


class QwenMoeDecoderLayer(PreNormDecoderLayer):
    """The shared pre-norm block around `SelfAttention` and the experts (as `mlp`): a `SharedExpertMoE` when the
    config has a shared expert (Qwen2-MoE), else a `FusedMoE` (Qwen3-MoE)."""

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
            raise ValueError(
                f"{config.architecture}: hidden_act {config.hidden_act!r} (only 'silu': the experts are SwiGLU)"
            )
        mlp: FusedMoE
        if config.shared_expert_intermediate_size:
            mlp = SharedExpertMoE(config, dtype=dtype, device=device, tp=tp)
        else:
            mlp = FusedMoE(
                config.num_experts,
                config.num_experts_per_tok,
                config.hidden_size,
                config.moe_intermediate_size,
                routing=_routing(config),
                expert_names=_EXPERT_NAMES,
                dtype=dtype,
                device=device,
                tp=tp,
            )
        super().__init__(
            config,
            SelfAttention(config, backend, dtype=dtype, device=device, tp=tp),
            mlp,
            dtype=dtype,
            device=device,
        )


class QwenMoeForCausalLM(DecoderForCausalLM):
    """A Qwen2-MoE or Qwen3-MoE causal LM (see `DecoderForCausalLM` for the cache, forward and tensor-parallel
    invariants): layer i is a `QwenMoeDecoderLayer` when `config.layer_has_experts(i)`, else a dense
    `LlamaDecoderLayer`; no fused decode path."""

    decoder_layer = QwenMoeDecoderLayer

    def layer_factories(self, config: TransformerConfig) -> list[DecoderLayerFactory]:
        return [
            QwenMoeDecoderLayer if config.layer_has_experts(i) else LlamaDecoderLayer
            for i in range(config.num_hidden_layers)
        ]

    def checkpoint_target(self, checkpoint_name: str) -> tuple[str, object] | None:
        """`...mlp.experts.<e>.gate_proj|up_proj|down_proj.weight` -> the layer's stacked expert parameter and
        (expert, part) shard; anything else (router, shared expert, dense layers): None, the usual mapping."""
        prefix, _, suffix = checkpoint_name.partition(_MLP)
        if not suffix.startswith("experts."):
            return None
        module_name = f"{prefix}.mlp"
        try:
            moe = self.get_submodule(module_name)
        except AttributeError:
            return None
        target = moe.checkpoint_target(suffix) if isinstance(moe, FusedMoE) else None
        return None if target is None else (f"{module_name}.{target[0]}", target[1])

    def checkpoint_index(self, checkpoint_name: str) -> tuple[slice, ...]:
        """This rank's part of a checkpoint tensor: the `FusedMoE`'s cut of a routed expert's tensor, else the
        default (the shared expert's gate/up rows and down columns as a `GatedMLP`'s; router and gate whole)."""
        if self.tp.size > 1 and _MLP in checkpoint_name:
            index = expert_checkpoint_index(self, checkpoint_name)
            if index is not None:
                return index
        return super().checkpoint_index(checkpoint_name)


class Qwen2MoeForCausalLM(QwenMoeForCausalLM):
    """Qwen2-MoE (`Qwen2MoeForCausalLM`): q/k/v bias, a shared expert, top-k weights as the softmax gives them unless
    `norm_topk_prob` (see `QwenMoeForCausalLM`)."""


class Qwen3MoeForCausalLM(QwenMoeForCausalLM):
    """Qwen3-MoE (`Qwen3MoeForCausalLM`): per-head q/k RMSNorm, no shared expert, top-k weights renormalised with
    `norm_topk_prob` (see `QwenMoeForCausalLM`)."""
