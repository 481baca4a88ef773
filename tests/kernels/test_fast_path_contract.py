"""The fast-path contract between linear methods and the fused decode layer: each `LinearMethod` states its own
fused product (`fused_decode_product`), and `kvflow.models.fused_decode` inspects no quantization class."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import kvflow.models.fused_decode as fused_decode
from kvflow.kernels import quant, quant_plan
from kvflow.models.layers.linear import FusedProduct, Linear, LinearMethod, QuantRun
from kvflow.models.quantization.int8 import Int8Linear
from tests.kernels.quant_static import static_quant_plans  # noqa: F401


def test_a_linear_method_states_no_fused_product_by_default() -> None:
    class Plain(LinearMethod):
        name = "plain"

    assert Plain().fused_decode_product() is None


def test_fused_decode_imports_no_quantization_module_and_reads_no_function_names() -> None:
    tree = ast.parse(Path(fused_decode.__file__).read_text())
    imported = {
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert not any(name and name.startswith("kvflow.models.quantization") for name in imported)
    assert not any(
        isinstance(node, ast.Attribute) and node.attr == "__name__" for node in ast.walk(tree)
    )


def test_an_int8_layer_states_its_run_and_row_limit(monkeypatch) -> None:
    layer = Linear(64, [32, 16], bias=True, dtype=torch.float32, device="cpu")
    monkeypatch.setattr(
        quant, "_kernel_ops", lambda: object()
    )  # the products chosen at load: the kernels
    product = Int8Linear(layer).fused_decode_product()
    rows = quant.kernel_rows("int8")
    assert product == FusedProduct(
        runs=(
            QuantRun(
                layer.weight,
                quant.INT8_TYPE_CODE,
                layer.weight_scale,
                layer.bias,
                rows.gemv_max_rows,
            ),
        ),
        max_rows=rows.max_rows,
    )
    monkeypatch.setattr(
        quant, "_kernel_ops", lambda: None
    )  # the reference products: no fused product
    assert (
        Int8Linear(
            Linear(64, 8, bias=False, dtype=torch.float32, device="cpu")
        ).fused_decode_product()
        is None
    )


def test_kernel_rows_hold_each_types_thresholds() -> None:
    """The static plan's rows one extension call covers: Q8_0 its GEMV then the tiled kernel up to
    QUANT_TILED_MAX_ROWS; int8 W8A8 above the GEMV at every M where built (AVX-512 VNNI), else the tiled kernel up
    to INT8_TILED_MAX_ROWS; the integer products every M."""
    assert quant.kernel_rows("Q8_0") == quant.KernelRows(
        quant.QUANT_GEMV_MAX_ROWS, quant.QUANT_TILED_MAX_ROWS
    )
    int8_limit = None if quant_plan.w8a8_built() else quant.INT8_TILED_MAX_ROWS
    assert quant.kernel_rows("int8") == quant.KernelRows(quant.QUANT_GEMV_MAX_ROWS, int8_limit)
    for qtype in quant.INTEGER_PRODUCT_TYPES:
        assert quant.kernel_rows(qtype) == quant.KernelRows(None, None)
        assert quant.kernel_rows(qtype).gemv_rows_for(37) == 37
