"""A mixture-of-experts feed-forward block (`FusedMoE`): router, top-k routing, experts grouped by token.

It takes `GatedMLP`'s place in a decoder layer (`[num_tokens, hidden_size]` in and out). Per step: router logits
`x @ gate.T`, the routing rule (a parameter: `softmax_topk` renormalised for Mixtral; Qwen2-MoE / Qwen3-MoE pick
theirs) gives each token `top_k` experts and weights; the (token, slot) pairs are grouped per expert, and each
expert's gate_up and down products run once over all its tokens; each result is multiplied by its routing weight
and the `top_k` results of a token are added in ascending expert order (transformers' `index_add_` order).

What runs where: the router product and the routing rule are PyTorch (rules differ per model). The experts run in
the C++ kernel (`kvflow.kernels.fused_moe`, csrc/fused_moe.cpp) for CPU bfloat16 / float32 tensors: each selected
expert's gate_up and down products run once over all the tokens that picked it (each weight byte read once), on
the GEMM kernel (csrc/gemm.cpp) for every group size from one token up: measured faster than the PyTorch path at
decode and about equal at prefill, and than the GEMV kernel above a few rows (benchmarks/moe_kernel.py,
benchmarks/RESULTS.md). Threads take whole experts when enough are selected, else split each product's rows.
Elsewhere (`KVFLOW_CPU_KERNELS=0`, no compiler, other devices or dtypes) the PyTorch path below runs: the fallback
and the reference the kernel is tested against (tests/kernels/test_fused_moe_kernel.py). `FusedMoE.experts` is the
one place choosing the path.

Batch independence (kernel path): every output element of the kernel's products sums its terms in an order fixed
by the shapes alone, not by how many tokens an expert got or how threads split the work, so a token's experts'
output is bitwise the same alone or in any batch. The router's `F.linear` is torch's and may differ in the last
bit with the batch size; the PyTorch experts path agrees across batches to float32 / bfloat16 rounding only.

Invariants: the expert weights are stacked, `w13_weight [num_experts, 2 * local, hidden]` (each expert's gate
rows, then its up rows) and `w2_weight [num_experts, hidden, local]`, where `local` is this rank's part of the
intermediate size (`intermediate_range`); they load from a checkpoint's per-expert tensors through their
`weight_loader`s with shard `(expert, part)` (`checkpoint_target` maps the names, `checkpoint_index` cuts the
rank's rows of gate / up and columns of down). Tensor parallelism splits every expert's intermediate dimension
across the ranks (the router is replicated) and sums the layer's output with one all-reduce; expert parallelism
(whole experts per rank) is a later step.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvflow import kernels
from kvflow.distributed.parallel_state import TensorParallelGroup, split_evenly
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
    With tensor parallelism each rank holds `intermediate_range` of every expert's intermediate dimension and the
    output is all-reduced once; expert parallelism (experts divided among the ranks) is a later step.
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
        if not 0 < top_k <= num_experts:
            raise ValueError(f"FusedMoE: top_k {top_k} not in 1..num_experts ({num_experts})")
        self.num_experts = num_experts
        self.top_k = top_k
        self.intermediate_size = intermediate_size
        # (start, length) of every expert's intermediate dimension this rank holds.
        self.intermediate_range = split_evenly(
            intermediate_size, tp.size, tp.rank, "FusedMoE intermediate_size"
        )
        local = self.intermediate_range[1]
        self.tp = tp
        self.routing = routing
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, 2 * local, hidden_size, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.w2_weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, local, dtype=dtype, device=device),
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

    def checkpoint_index(self, param_name: str, shard: object) -> tuple[slice, ...]:
        """The part of an expert's checkpoint tensor this rank holds: rows `intermediate_range` of gate and of up
        (`w13_weight`), those columns of down (`w2_weight`); `()` (all of it) for one rank and for the router."""
        if self.tp.size == 1 or param_name not in ("w13_weight", "w2_weight"):
            return ()
        start, length = self.intermediate_range
        rows = slice(start, start + length)
        return (rows,) if param_name == "w13_weight" else (slice(None), rows)

    def _load_w13(self, param: nn.Parameter, loaded: CheckpointTensor, shard: object) -> None:
        expert, part = self._expert_index(shard)
        rows = self.intermediate_range[1]
        part_weight = narrow(loaded, self.checkpoint_index("w13_weight", shard))
        copy_checked(param.data[expert, part * rows : (part + 1) * rows], part_weight)

    def _load_w2(self, param: nn.Parameter, loaded: CheckpointTensor, shard: object) -> None:
        expert, _ = self._expert_index(shard)
        copy_checked(param.data[expert], narrow(loaded, self.checkpoint_index("w2_weight", shard)))

    # ------------------------------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        router_logits = F.linear(hidden_states, self.gate.weight)
        weights, ids = self.routing(router_logits, self.top_k)
        return self.tp.all_reduce(self.experts(hidden_states, weights, ids))

    def experts(
        self, hidden_states: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """The experts' weighted sum for each token (this rank's part of it): the C++ kernel where it applies,
        else the PyTorch path. The one place that chooses (a quantized-experts path plugs in here)."""
        out = kernels.fused_moe(hidden_states, self.w13_weight, self.w2_weight, weights, ids)
        return out if out is not None else self.experts_torch(hidden_states, weights, ids)

    def experts_torch(
        self, hidden_states: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """The PyTorch experts path (the kernel's fallback and reference): `weights` float32 and `ids`
        `[num_tokens, top_k]`."""
        num_tokens, hidden_size = hidden_states.shape
        top_k = self.top_k
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


def expert_checkpoint_index(model: nn.Module, checkpoint_name: str) -> tuple[slice, ...] | None:
    """The part of checkpoint tensor `checkpoint_name` a tensor-parallel rank reads when the model's
    `checkpoint_target` maps it to a `FusedMoE`'s stacked expert parameter (that layer's `checkpoint_index`);
    None for any other name (the caller's default applies). For a model's `checkpoint_index` override."""
    target = model.checkpoint_target(checkpoint_name)
    if target is None:
        return None
    name, shard = target
    module_name, _, param_name = name.rpartition(".")
    module = model.get_submodule(module_name)
    return module.checkpoint_index(param_name, shard) if isinstance(module, FusedMoE) else None
