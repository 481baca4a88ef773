"""Weight-only int8 with one float32 scale per output channel, quantized at load from a float checkpoint.

Every linear layer (fused QKV, output, gate/up and down projections) holds `weight` as int8 `[rows, columns]` and
`weight_scale` as float32 `[rows]`; its weight loader quantizes each checkpoint shard's rows as they arrive (rows
are output channels, so a fused layer's shards and a tensor-parallel rank's rows quantize independently; a
row-parallel rank quantizes its own columns of each row). Activations stay in the model dtype; the kernel widens the
int8 weights in registers (`kvflow.kernels.quant.int8_linear_for`); which product runs above the GEMV's rows is
measured on the layers' shapes when the plan applies (`kvflow.kernels.quant_choice`). A mixture-of-experts layer's
experts are int8 rows the same way (`FusedMoE.quantize_experts("int8", "int8")`, run by the int8 products through
`quant.fused_moe`); its router stays in the model dtype.

The token embedding stays in the model dtype (a lookup reads a few rows). The LM head stays in the model dtype too
unless `quantize_lm_head`: then it gets an int8 copy with its own scales, re-quantized after every load (it may be
tied to the float embedding), and the float table is kept for the embedding's lookups.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kvflow.kernels import quant
from kvflow.kernels.quant_choice import activation_dtype, choose_quant_gemm_plans
from kvflow.models.layers.fused_moe import FusedMoE
from kvflow.models.layers.linear import FusedProduct, Linear, LinearMethod, QuantRun
from kvflow.models.layers.vocab import LMHead
from kvflow.models.layers.weights import (
    CheckpointTensor,
    WeightShapeError,
    narrow,
    set_weight_loader,
)
from kvflow.models.quantization import INT8

logger = logging.getLogger(__name__)


class Int8Linear(LinearMethod):
    """The `LinearMethod` of one int8 layer: `weight` int8 `[rows, columns]`, buffer `weight_scale` float32
    `[rows]`; `weight[r] * weight_scale[r]` approximates the checkpoint's row r within `weight_scale[r] / 2`."""

    name = INT8

    def __init__(self, layer: Linear) -> None:
        self.layer = layer
        rows, columns = layer.weight.shape
        device = layer.weight.device
        layer.weight = nn.Parameter(
            torch.zeros(rows, columns, dtype=torch.int8, device=device), requires_grad=False
        )
        layer.register_buffer("weight_scale", torch.ones(rows, dtype=torch.float32, device=device))
        set_weight_loader(layer.weight, self.weight_loader)
        self._linear = quant.int8_linear_for()
        self._on_kernels = quant.kernels_in_use()

    @property
    def kernel_names(self) -> list[str]:
        """The product's name (`int8_linear_kernel` or `int8_linear_reference`), as GGUFLinear's for each run."""
        return [self._linear.__name__]

    def fused_decode_product(self) -> FusedProduct | None:
        """One int8 run on the kernels (`int8_linear`'s rows: `quant.kernel_rows("int8")`), or None on the
        reference path."""
        if not self._on_kernels:
            return None
        rows = quant.kernel_rows("int8")
        run = QuantRun(
            weight=self.layer.weight,
            type_code=quant.kernel_type_code("int8"),
            scale=self.layer.weight_scale,
            bias=self.layer.bias,
            gemv_max_rows=rows.gemv_max_rows,
        )
        return FusedProduct(runs=(run,), max_rows=rows.max_rows)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: CheckpointTensor, shard_id: int | None = None
    ) -> None:
        """Quantize this rank's part of checkpoint shard `shard_id` into that shard's rows."""
        part = narrow(loaded_weight, self.layer.checkpoint_index("weight", shard_id))
        rows = self.layer.shard_rows(shard_id)
        destination = param.data[rows]
        if tuple(destination.shape) != tuple(part.shape):
            raise WeightShapeError(
                f"checkpoint {tuple(part.shape)}, model {tuple(destination.shape)}"
            )
        qweight, scale = quant.int8_quantize(part.to(destination.device))
        with torch.no_grad():
            destination.copy_(qweight)
            self.layer.weight_scale[rows] = scale

    def apply(self, hidden_states: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._linear(hidden_states, self.layer.weight, self.layer.weight_scale, bias)


class Int8Head(LinearMethod):
    """The `LinearMethod` of an int8 LM head: an int8 copy (`weight_int8`, `weight_scale` buffers) of the float
    table, made by `requantize` after each load; the float `weight` stays (the embedding may share it)."""

    name = INT8

    def __init__(self, head: LMHead) -> None:
        self.head = head
        rows, columns = head.weight.shape
        device = head.weight.device
        head.register_buffer(
            "weight_int8", torch.zeros(rows, columns, dtype=torch.int8, device=device)
        )
        head.register_buffer("weight_scale", torch.ones(rows, dtype=torch.float32, device=device))
        self._linear = quant.int8_linear_for()

    def requantize(self) -> None:
        qweight, scale = quant.int8_quantize(self.head.weight.data)
        with torch.no_grad():
            self.head.weight_int8.copy_(qweight)
            self.head.weight_scale.copy_(scale)

    def apply(self, hidden_states: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._linear(hidden_states, self.head.weight_int8, self.head.weight_scale, bias)


class Int8Plan:
    """`quantization="int8"`: every `Linear` becomes an `Int8Linear`; with `quantize_lm_head` the LM head gets an
    `Int8Head`."""

    name = INT8

    def __init__(self, *, quantize_lm_head: bool = False) -> None:
        self.quantize_lm_head = quantize_lm_head

    def apply(self, model: nn.Module) -> None:
        count = 0
        shapes: set[tuple[int, int]] = set()
        for module in model.modules():
            if isinstance(module, Linear):
                module.quant_method = Int8Linear(module)
                shapes.add((module.weight.shape[0], module.weight.shape[1]))
                count += 1
        # Before the model picks its fast paths: the fused decode layer's row limit follows the measured plan.
        choose_quant_gemm_plans({INT8: shapes}, dtype=activation_dtype(model))
        experts = 0
        for module in model.modules():
            if isinstance(module, FusedMoE):
                module.quantize_experts(INT8, INT8)
                experts += 1
        if self.quantize_lm_head:
            for module in model.modules():
                if isinstance(module, LMHead):
                    module.quant_method = Int8Head(module)
        logger.info(
            "int8 weight-only quantization: %d linear layers, %d expert layers%s, kernel %s",
            count,
            experts,
            " and the LM head" if self.quantize_lm_head else " (LM head and embedding unquantized)",
            getattr(quant.int8_linear_for(), "__name__", "?"),
        )

    def after_loading(self, model: nn.Module) -> None:
        for module in model.modules():
            if isinstance(module, LMHead) and isinstance(module.quant_method, Int8Head):
                module.quant_method.requantize()
