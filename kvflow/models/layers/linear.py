"""Linear layers whose weight may stack several checkpoint projections (fused QKV, fused gate/up), and their
tensor-parallel forms (column-parallel: output rows split; row-parallel: input columns split, then all-reduced).

Each layer's `weight` and `bias` carry its `weight_loader` (see `kvflow.models.layers.weights`): it cuts this rank's
part out of a checkpoint tensor (`checkpoint_index`) and copies it into the rows of shard `shard_id`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvflow import kernels
from kvflow.models.layers.weights import CheckpointTensor, copy_checked, narrow, set_weight_loader

if TYPE_CHECKING:
    from kvflow.distributed import TensorParallelGroup
    from kvflow.lora.layers import LoRALayerWeights


@dataclass(frozen=True)
class QuantRun:
    """One run of a quantized product's output rows as the C++ kernels take it (`decode_layer_quantized`): `weight`
    GGUF blocks `[rows, row_bytes]` or int8 `[rows, columns]`, its `type_code`
    (`kvflow.kernels.quant.kernel_type_code`), the int8 rows' float32 `scale` (else None), the layer bias's rows
    (else None), and the `gemv_max_rows` the per-op product passes the extension (None: the step's row count;
    `kvflow.kernels.quant.KernelRows`)."""

    weight: torch.Tensor
    type_code: int
    scale: torch.Tensor | None
    bias: torch.Tensor | None
    gemv_max_rows: int | None


@dataclass(frozen=True)
class FusedProduct:
    """A layer's product as the fused decode layer runs it (`kvflow.models.fused_decode`): `runs`, whose outputs
    (each rounded to the activations' dtype) concatenate in order, and `max_rows`, the most activation rows for
    which `LinearMethod.apply` multiplies on those very kernels (None: every row count)."""

    runs: tuple[QuantRun, ...]
    max_rows: int | None


class LinearMethod:
    """How a layer whose weight is stored another way (quantized: `kvflow.models.quantization`) multiplies.

    Built once per layer when the model is built, before its weights load: it replaces the layer's `weight` with its
    own storage (and that parameter's `weight_loader`) and picks the kernel for this CPU; `apply` is then
    `F.linear(hidden_states, dequantized weight, bias)` up to the kernel's accumulation error.
    `fused_decode_product` states the method's fast path, decided with the kernel: the runs the fused decode layer
    may call in place of `apply`, bit for bit the same products, or None (the default) where there are none."""

    name: str

    def apply(self, hidden_states: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def fused_decode_product(self) -> FusedProduct | None:
        """This layer's product on the C++ kernels for the fused decode layer, or None: `apply` runs elsewhere (the
        PyTorch reference, a float run) or the method has no fused form."""
        return None


# The fewest rows a batch-invariant product multiplies (`row_invariant_linear`).
ROW_INVARIANT_MIN_ROWS = 64


def row_invariant_linear(
    hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`F.linear` whose rows come out the same whatever rows are multiplied with them: PyTorch's GEMM on at least
    `ROW_INVARIANT_MIN_ROWS` rows (fewer are padded with zeros). A product of few rows takes another algorithm,
    which orders a row's sums otherwise (kvflow's kernels switch from GEMV to GEMM by rows; MKL's float32 GEMM has
    a path of its own for 2-3 rows); from a few dozen rows on, the CPU GEMMs compute each row alike whatever the row
    count (the pooling tests check it bit for bit)."""
    rows = hidden_states.reshape(-1, hidden_states.shape[-1])
    num_rows = rows.shape[0]
    if num_rows >= ROW_INVARIANT_MIN_ROWS:
        out = F.linear(rows, weight, bias)
    else:
        out = F.linear(F.pad(rows, (0, 0, 0, ROW_INVARIANT_MIN_ROWS - num_rows)), weight, bias)
        out = out[:num_rows]
    return out.view(*hidden_states.shape[:-1], weight.shape[0])


class Linear(nn.Module):
    """`y = x @ weight.T (+ bias)`, where `weight` stacks `len(output_sizes)` shards along its rows.

    Invariants: `weight` is `[sum(output_sizes), input_size]` (and `bias`, when present, `[sum(output_sizes)]`);
    shard `i` owns rows `shard_rows(i)`, so one matmul computes every fused projection and the checkpoint's separate
    tensors load into their own row ranges (`weight_loader` with `shard_id=i`; `shard_id=None` is the whole
    parameter, for an unfused layer or a checkpoint that ships the fused tensor).
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: int | Sequence[int],
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.output_sizes = (
            (output_sizes,) if isinstance(output_sizes, int) else tuple(output_sizes)
        )
        self.input_size = input_size
        total = sum(self.output_sizes)
        self.weight = nn.Parameter(
            torch.empty(total, input_size, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.zeros(total, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )
        set_weight_loader(self.weight, self.weight_loader)
        set_weight_loader(self.bias, self.weight_loader)
        # Set by a quantization method (`LinearMethod`) before loading; None: `weight` is a plain float matrix.
        self.quant_method: LinearMethod | None = None
        # Set by the LoRA manager (`kvflow.lora.model_manager`) on layers adapters may target; None: no adapters.
        self.lora: LoRALayerWeights | None = None
        # Batch-invariant products (the pooling runner sets it; see `row_invariant_linear`): a row's result does
        # not depend on the rows multiplied with it.
        self.row_invariant = False

    def shard_rows(self, shard: int | None) -> slice:
        """The rows of `weight` (and entries of `bias`) that shard `shard` occupies (None: all of them)."""
        if shard is None:
            return slice(None)
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: CheckpointTensor, shard_id: int | None = None
    ) -> None:
        """Copy this rank's part of checkpoint shard `shard_id`'s tensor into that shard's rows of `param`."""
        param_name = "bias" if param is self.bias else "weight"
        part = narrow(loaded_weight, self.checkpoint_index(param_name, shard_id))
        copy_checked(param.data[self.shard_rows(shard_id)], part)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.matmul(hidden_states, self.bias)

    def matmul(self, hidden_states: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`hidden_states @ weight.T (+ bias)`: the quantization method's kernel, else the float one; plus, with
        adapters in the step, each adapter row's LoRA delta (base-model rows are left as the product gave them)."""
        if self.quant_method is not None:
            out = self.quant_method.apply(hidden_states, bias)
        elif self.row_invariant:
            out = row_invariant_linear(hidden_states, self.weight, bias)
        else:
            out = kernels.linear(hidden_states, self.weight, bias)  # CPU GEMV/GEMM, else None
            if out is None:
                out = F.linear(hidden_states, self.weight, bias)
        if self.lora is not None:
            self.lora.add_delta(out, hidden_states)
        return out

    def checkpoint_index(self, param_name: str, shard: int | None) -> tuple[slice, ...]:
        """The part of checkpoint shard `shard`'s tensor for `param_name` ("weight" or "bias") this layer holds:
        `()`, all of it (the layer is not split across ranks)."""
        return ()


class ColumnParallelLinear(Linear):
    """A `Linear` whose output rows are split across tensor-parallel ranks; its output stays split (no collective).

    Invariants: `row_ranges[i] = (start, length)` are the rows of checkpoint shard i's tensor (q, k, v or gate, up)
    this rank holds, so `output_sizes[i] == length`; the bias, when present, is split the same way. With one rank
    every range is the whole shard and the layer is exactly a `Linear`.
    """

    def __init__(
        self,
        input_size: int,
        row_ranges: Sequence[tuple[int, int]],
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__(
            input_size, [length for _, length in row_ranges], bias=bias, dtype=dtype, device=device
        )
        self.row_ranges = tuple(row_ranges)

    def checkpoint_index(self, param_name: str, shard: int | None) -> tuple[slice, ...]:
        if shard is None:  # a fused checkpoint tensor: whole (its rows are not contiguous per rank)
            return ()
        start, length = self.row_ranges[shard]
        return (slice(start, start + length),)


class RowParallelLinear(Linear):
    """A `Linear` whose input columns are split across tensor-parallel ranks: each rank multiplies its columns of
    the input (the split output of a `ColumnParallelLinear`), then one all-reduce sums the partial products.

    Invariants: `weight` is `[output_size, column_range[1]]`, columns `column_range` of the checkpoint's weight; the
    bias (when the checkpoint has one) is held whole by every rank but added by the first rank only, so the sum adds
    it once. `forward` is the local matmul followed by `tp.all_reduce`, a no-op for one rank.
    """

    def __init__(
        self,
        column_range: tuple[int, int],
        output_size: int,
        *,
        bias: bool,
        tp: TensorParallelGroup,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__(column_range[1], output_size, bias=bias, dtype=dtype, device=device)
        self.column_range = column_range
        self.adds_bias = tp.is_first_rank
        self.tp = tp

    def checkpoint_index(self, param_name: str, shard: int | None) -> tuple[slice, ...]:
        if param_name == "bias":
            return ()
        start, length = self.column_range
        return (slice(None), slice(start, start + length))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.matmul(hidden_states, self.bias if self.adds_bias else None))
