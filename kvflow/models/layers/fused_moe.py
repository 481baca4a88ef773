"""A mixture-of-experts feed-forward block (`FusedMoE`): router, top-k routing, experts grouped by token.

It takes `GatedMLP`'s place in a decoder layer (`[num_tokens, hidden_size]` in and out). Per step: router logits
`x @ gate.T`, the routing rule (a parameter: `softmax_topk` renormalised for Mixtral; Qwen2-MoE / Qwen3-MoE pick
theirs) gives each token `top_k` experts and weights; the (token, slot) pairs are grouped per expert, and each
expert's gate_up and down products run once over all its tokens; each result is multiplied by its routing weight
and the `top_k` results of a token are added in ascending expert order (transformers' `index_add_` order).

This is the PyTorch implementation; the C++ kernel (grouped GEMM for prefill, a GEMV path per selected expert for
decode) is a later step.

Invariants: the expert weights are stacked, `w13_weight [num_experts, 2 * intermediate, hidden]` (each expert's
gate rows, then its up rows) and `w2_weight [num_experts, hidden, intermediate]`; they load from a checkpoint's
per-expert tensors through their `weight_loader`s with shard `(expert, part)` (`checkpoint_target` maps the names).
A token's output depends only on that token (its own routing and its own rows of each product), not on the rest
of the batch, up to the matrix-product library's blocking (see tests/models/test_mixtral_vs_hf.py). Tensor
parallelism (tp > 1) is refused at construction for now (splitting experts' intermediate dimension is a later
step, and expert parallelism after it).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.distributed.parallel_state import TensorParallelGroup
from kvflow.models.layers.weights import CheckpointTensor, copy_checked, narrow, set_weight_loader

# (router logits [tokens, experts], top_k) -> (weights float32 [tokens, top_k], expert ids [tokens, top_k]).
RoutingFunction = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def softmax_topk(
    router_logits: torch.Tensor, top_k: int, *, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts in float32, the `top_k` largest, renormalised to sum to 1 when `renormalize`
    (Mixtral's rule, transformers' `MixtralTopKRouter`; Qwen2-MoE without `norm_topk_prob`: not renormalised)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(nn.Module):
    """Router (`gate.weight [num_experts, hidden]`) and `num_experts` SwiGLU experts stacked in two parameters.

    `expert_names` are the checkpoint's per-expert module names (gate, up, down): Mixtral's `w1`, `w3`, `w2`.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        routing: RoutingFunction = softmax_topk,
        expert_names: tuple[str, str, str] = ("w1", "w3", "w2"),
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallelGroup,
    ) -> None:
        super().__init__()
        if tp.size > 1:
            raise ValueError(
                f"FusedMoE: tensor parallelism (tp={tp.size}) is not supported yet for mixture-of-experts "
                "models; run them with tensor_parallel_size=1"
            )
        if not 0 < top_k <= num_experts:
            raise ValueError(f"FusedMoE: top_k {top_k} not in 1..num_experts ({num_experts})")
        self.num_experts = num_experts
        self.top_k = top_k
        self.intermediate_size = intermediate_size
        self.routing = routing
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.w13_weight = nn.Parameter(
            torch.empty(
                num_experts, 2 * intermediate_size, hidden_size, dtype=dtype, device=device
            ),
            requires_grad=False,
        )
        self.w2_weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype, device=device),
            requires_grad=False,
        )
        set_weight_loader(self.w13_weight, self._load_w13)
        set_weight_loader(self.w2_weight, self._load_w2)
        # The shards `load_weights` expects a whole checkpoint to fill.
        for param_name, shards in self.expert_shards().items():
            getattr(self, param_name).checkpoint_shards = shards
        gate, up, down = (re.escape(name) for name in expert_names)
        self._expert_pattern = re.compile(rf"\.experts\.(\d+)\.({gate}|{up}|{down})\.weight$")
        self._parts = {expert_names[0]: ("w13_weight", 0), expert_names[1]: ("w13_weight", 1)}
        self._parts[expert_names[2]] = ("w2_weight", 0)

    # ------------------------------------------------------------------------------------------ weights
    def expert_shards(self) -> dict[str, tuple[tuple[int, int], ...]]:
        """Every (expert, part) shard a whole checkpoint fills, per stacked parameter."""
        experts = range(self.num_experts)
        return {
            "w13_weight": tuple((e, part) for e in experts for part in (0, 1)),
            "w2_weight": tuple((e, 0) for e in experts),
        }

    def checkpoint_target(self, suffix: str) -> tuple[str, tuple[int, int]] | None:
        """`experts.<e>.<name>.weight` (relative to this module) -> (stacked parameter, (e, part)); else None."""
        match = self._expert_pattern.search("." + suffix)
        if match is None:
            return None
        param_name, part = self._parts[match.group(2)]
        return param_name, (int(match.group(1)), part)

    def _expert_index(self, shard: object) -> tuple[int, int]:
        if not (isinstance(shard, tuple) and len(shard) == 2):
            raise ValueError(
                f"FusedMoE: an expert weight needs an (expert, part) shard, got {shard!r}"
            )
        expert, part = shard
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"FusedMoE: expert {expert} out of range ({self.num_experts} experts)")
        return expert, part

    def _load_w13(self, param: nn.Parameter, loaded: CheckpointTensor, shard: object) -> None:
        expert, part = self._expert_index(shard)
        rows = self.intermediate_size
        copy_checked(param.data[expert, part * rows : (part + 1) * rows], narrow(loaded, ()))

    def _load_w2(self, param: nn.Parameter, loaded: CheckpointTensor, shard: object) -> None:
        expert, _ = self._expert_index(shard)
        copy_checked(param.data[expert], narrow(loaded, ()))

    # ------------------------------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens, hidden_size = hidden_states.shape
        top_k = self.top_k
        router_logits = F.linear(hidden_states, self.gate.weight)
        weights, ids = self.routing(router_logits, top_k)
        # Each token's slots in ascending expert order, so its results add up in transformers' order.
        ids, order = ids.sort(dim=-1)
        weights = weights.gather(-1, order)
        flat_ids = ids.reshape(-1)
        flat_weights = weights.reshape(-1)
        pairs = torch.argsort(flat_ids, stable=True)  # (token, slot) pairs grouped per expert
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        results = hidden_states.new_empty(num_tokens * top_k, hidden_size)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = pairs[start : start + count]
            start += count
            tokens = hidden_states.index_select(0, rows // top_k)
            gate, up = F.linear(tokens, self.w13_weight[expert]).chunk(2, dim=-1)
            out = F.linear(F.silu(gate) * up, self.w2_weight[expert])
            results[rows] = (out * flat_weights[rows, None]).to(results.dtype)
        results = results.view(num_tokens, top_k, hidden_size)
        output = results[:, 0]
        for slot in range(1, top_k):
            output = output + results[:, slot]
        return output
