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

Quantized experts (`quantize_experts`: a GGUF file's blocks, kept by `gguf_plan`, or int8 rows from
`quantization="int8"`): `w13_weight` / `w2_weight` hold `[num_experts, rows, row_bytes]` GGUF blocks (uint8, the
file's bytes) or int8 `[num_experts, rows, columns]` with float32 `w13_scale` / `w2_scale` per row. They run in one
C++ call per layer (`kvflow.kernels.quant.fused_moe`, csrc/quant_moe.cpp): the loop over the selected experts is in
C++, each expert's gate_up and down products over the tokens that picked it on the dense layers' quantized products
(the GEMV for decode-sized groups, the interleaved / tiled / W8A8 products above, by the same row thresholds as a
dense layer of that many rows), results weighted and summed in float32. Without the kernels `experts_quantized`
runs the same products one expert at a time (`quant.ggml_linear` / `quant.int8_linear`, their references).
Batch independence (quantized kernel path): a token's output is bitwise the same alone or in any batch in which each
of its experts gets at most `quant.QUANT_GEMV_MAX_ROWS` (8) tokens, every product then being the GEMV, which sums
each row alone in a fixed order (tests/kernels/test_moe_quant_kernel.py); above that an expert's group runs on the
dense prefill products (the 4-bit types: the same integer dots summed in another order; Q8_0 / int8: W8A8 above 32 /
8 rows), as a dense layer's rows do.

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
from kvflow.kernels import quant
from kvflow.models.layers.weights import (
    CheckpointTensor,
    WeightShapeError,
    copy_checked,
    narrow,
    set_weight_loader,
)

INT8 = "int8"  # quantize_experts' weight type for int8 rows (kvflow.models.quantization.INT8)

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
        self.expert_names = expert_names
        # None: float experts (the model dtype); else the storage `quantize_experts` made (GGUF types or "int8").
        self.w13_type: str | None = None
        self.w2_type: str | None = None
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

    def quantize_experts(self, w13_type: str, w2_type: str) -> None:
        """Swap the float expert stacks for quantized storage, before any weight loads: GGUF blocks (`w13_type` for
        gate and up, `w2_type` for down, each one of `kvflow.kernels.quant.GGML_BLOCK_SIZES`: uint8
        `[num_experts, rows, row_bytes]`, the loaders copy the file's blocks), or `"int8"` for both (int8 rows with a
        float32 scale per row, `w13_scale [num_experts, 2 * local]` / `w2_scale [num_experts, hidden]`, the loaders
        quantize each float row as `quant.int8_quantize`). ValueError when a row is no whole number of blocks (a
        tensor-parallel split of the intermediate dimension that cuts the down projection's blocks)."""
        num_experts, rows13, hidden = self.w13_weight.shape
        local = self.intermediate_range[1]
        device = self.w13_weight.device
        if (w13_type == INT8) != (w2_type == INT8):
            raise ValueError(
                f"FusedMoE: int8 experts quantize every product, got {w13_type} / {w2_type}"
            )
        if w13_type == INT8:
            w13 = torch.zeros(num_experts, rows13, hidden, dtype=torch.int8, device=device)
            w2 = torch.zeros(num_experts, hidden, local, dtype=torch.int8, device=device)
            self.register_buffer("w13_scale", torch.ones(num_experts, rows13, device=device))
            self.register_buffer("w2_scale", torch.ones(num_experts, hidden, device=device))
        else:
            try:
                w13_bytes = quant.ggml_row_bytes(w13_type, hidden)
                w2_bytes = quant.ggml_row_bytes(w2_type, local)
            except ValueError as error:
                raise ValueError(
                    f"FusedMoE: experts kept as GGUF blocks need whole blocks per row ({error}); with tensor "
                    f"parallelism each rank's {local} of the intermediate {self.intermediate_size} columns of the "
                    "down projection must be whole blocks: use fewer ranks"
                ) from None
            w13 = torch.zeros(num_experts, rows13, w13_bytes, dtype=torch.uint8, device=device)
            w2 = torch.zeros(num_experts, hidden, w2_bytes, dtype=torch.uint8, device=device)
        shards = self.expert_shards()
        for name, data, loader in (
            ("w13_weight", w13, self._load_w13),
            ("w2_weight", w2, self._load_w2),
        ):
            param = nn.Parameter(data, requires_grad=False)
            set_weight_loader(param, loader)
            param.checkpoint_shards = shards[name]
            setattr(self, name, param)
        self.w13_type, self.w2_type = w13_type, w2_type

    def expert_weight_bytes(self) -> int:
        """The bytes the experts' weights (and int8 scales) hold in memory."""
        tensors = [self.w13_weight, self.w2_weight]
        if self.w13_type == INT8:
            tensors += [self.w13_scale, self.w2_scale]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _load_w13(self, param: nn.Parameter, loaded: CheckpointTensor, shard: object) -> None:
        expert, part = self._expert_index(shard)
        rows = self.intermediate_range[1]
        part_weight = narrow(loaded, self.checkpoint_index("w13_weight", shard))
        self._store("w13", expert, slice(part * rows, (part + 1) * rows), part_weight)

    def _load_w2(self, param: nn.Parameter, loaded: CheckpointTensor, shard: object) -> None:
        expert, _ = self._expert_index(shard)
        self._store(
            "w2", expert, slice(None), narrow(loaded, self.checkpoint_index("w2_weight", shard))
        )

    def _store(self, name: str, expert: int, rows: slice, part: object) -> None:
        """One checkpoint part into rows `rows` of expert `expert` of `{name}_weight`, as its storage holds it:
        float (GGUF blocks dequantized), the file's GGUF blocks as they are, or int8 quantized per row."""
        destination = getattr(self, f"{name}_weight").data[expert, rows]
        weight_type = getattr(self, f"{name}_type")
        blocks_type = getattr(part, "qtype", None)  # a GGUF file's tensor (gguf_file.GGUFTensor)
        if weight_type is None or weight_type == INT8:
            if blocks_type is not None:  # experts the plan left in float: the blocks dequantized
                part = quant.dequantize(blocks_type, part.data).view(part.shape)
            if weight_type is None:
                copy_checked(destination, part)
                return
            if tuple(destination.shape) != tuple(part.shape):
                raise WeightShapeError(
                    f"checkpoint {tuple(part.shape)}, model {tuple(destination.shape)}"
                )
            qweight, scale = quant.int8_quantize(part.to(destination.device))
            with torch.no_grad():
                destination.copy_(qweight)
                getattr(self, f"{name}_scale")[expert, rows] = scale
            return
        if blocks_type != weight_type:
            raise ValueError(
                f"FusedMoE: the experts' {name} is stored as GGUF {weight_type} blocks; got "
                f"{blocks_type or 'float weights'} (weight updates into GGUF experts are not supported)"
            )
        copy_checked(destination, part.data)

    # ------------------------------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.partial(hidden_states))

    def partial(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """This rank's part of the block's output before the all-reduce (the whole output with one rank): the
        router's top-k choice and the chosen experts' weighted sum. A subclass adding a term of its own (a shared
        expert) adds its partial here, so the block still reduces once."""
        router_logits = F.linear(hidden_states, self.gate.weight)
        weights, ids = self.routing(router_logits, self.top_k)
        return self.experts(hidden_states, weights, ids)

    def experts(
        self, hidden_states: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """The experts' weighted sum for each token (this rank's part of it): the C++ kernel where it applies,
        else the PyTorch path; for quantized experts `quant.fused_moe` (one C++ call) else `experts_quantized`.
        The one place that chooses."""
        if self.w13_type is not None:
            out = quant.fused_moe(hidden_states, *self._quantized_weights(), weights, ids)
            return out if out is not None else self.experts_quantized(hidden_states, weights, ids)
        out = kernels.fused_moe(hidden_states, self.w13_weight, self.w2_weight, weights, ids)
        return out if out is not None else self.experts_torch(hidden_states, weights, ids)

    def _quantized_weights(self) -> tuple:
        """(w13, w13_type, w13_scale, w2, w2_type, w2_scale) as `quant.fused_moe` takes them."""
        int8 = self.w13_type == INT8
        return (
            self.w13_weight,
            self.w13_type,
            self.w13_scale if int8 else None,
            self.w2_weight,
            self.w2_type,
            self.w2_scale if int8 else None,
        )

    def experts_quantized(
        self, hidden_states: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """The quantized experts in PyTorch, one `quant.ggml_linear` / `quant.int8_linear` per product (their C++
        kernels or their references): what the C++ path computes, summed the same way (fp32 weighting, a
        token's results added in ascending expert order in fp32, one cast); the fallback and a test reference."""
        w13, w13_type, w13_scale, w2, w2_type, w2_scale = self._quantized_weights()

        def product(x: torch.Tensor, weight: torch.Tensor, qtype: str, scale: torch.Tensor | None):
            if qtype == INT8:
                return quant.int8_linear(x, weight, scale)
            return quant.ggml_linear(x, qtype, weight)

        x = hidden_states.float()
        ids, order = ids.sort(dim=-1)
        weights = weights.float().gather(-1, order)
        results = torch.zeros(*ids.shape, x.shape[-1])
        for expert in ids.unique().tolist():
            tokens, slots = (ids == expert).nonzero(as_tuple=True)
            scale13 = None if w13_scale is None else w13_scale[expert]
            scale2 = None if w2_scale is None else w2_scale[expert]
            gate, up = product(x[tokens], w13[expert], w13_type, scale13).chunk(2, dim=-1)
            down = product(F.silu(gate) * up, w2[expert], w2_type, scale2)
            results[tokens, slots] = down * weights[tokens, slots, None]
        output = results[:, 0]
        for slot in range(1, ids.shape[1]):
            output = output + results[:, slot]
        return output.to(hidden_states.dtype)

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
