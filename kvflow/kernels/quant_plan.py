"""Which product a quantized weight type runs for each band of activation rows above the GEMV's: the plan.

Up to `QUANT_GEMV_MAX_ROWS` rows (decode) every type runs its GEMV. Above, each band of row counts
(`QUANT_GEMM_BANDS`, the bfloat16 plan's bands) runs one of these products (`kvflow.kernels.quant.run_product`):

* `GEMV`: the extension's product with `gemv_max_rows` at the step's row count: for Q4_0 / Q4_K / Q6_K the integer
  product (blocked GEMV, interleaved tiles on AVX-512 VNNI builds), for Q8_0 the GEMV on x quantized per 32
  (integer dots; float32 x under `KVFLOW_Q8_0_ACTIVATIONS=float32`, `q8_0_activations`), for int8 the float32-x GEMV;
* `TILED`: the extension's product above its `gemv_max_rows`: a thread-local fp32 tile of dequantized weight rows
  against every x row (Q4_0 / Q4_K / Q6_K, and Q8_0 unless float32, on fake-quantized x); for int8 on AVX-512
  VNNI builds that same call is W8A8, so there it is named `W8A8`;
* `W8A8`: each x row quantized alone, exact int32 dots (Q8_0: `ggml_linear_w8a8`; int8: the call above);
* `DEQUANT`: the whole weight dequantized in C++, then torch's fp32 GEMM (on fake-quantized x where the GEMV
  quantizes x per block).

The static plan (`static_quant_plan`) holds the thresholds measured on Intel and AVX2 EPYCs (benchmarks/RESULTS.md,
"Quantized products, dispatch and thresholds"); a model built under `KVFLOW_QUANT_GEMM` "auto" (the default) measures
its own (`kvflow.kernels.quant_choice`) and makes it the process's plan for each type its layers hold. The fused
decode layer runs the plan's first stretch of bands that the extension's one call covers (`QuantGemmPlan.kernel_rows`),
so it and the per-op products call the same kernels for every row count it takes.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

from kvflow.kernels.build import load_cpu_kernels
from kvflow.kernels.choice import KernelChoice, describe_bands

GEMV = "gemv"
TILED = "tiled"
W8A8 = "w8a8"
DEQUANT = "dequant"

# `KVFLOW_QUANT_GEMM`: "auto" (the default): each model measures the products of its weight types' bands;
# "static": the thresholds below, measuring nothing.
QUANT_GEMM_ENV = "KVFLOW_QUANT_GEMM"
QUANT_GEMM_CHOICES = ("auto", "static")
# `KVFLOW_Q8_0_ACTIVATIONS`: "int8" (the default): Q8_0 products quantize x per 32 elements; "float32": they keep
# float32 x (`q8_0_activations`).
Q8_0_ACTIVATIONS_ENV = "KVFLOW_Q8_0_ACTIVATIONS"
Q8_0_ACTIVATIONS_CHOICES = ("int8", "float32")

# Up to this many activation rows every type runs its GEMV (decode, speculative verification).
QUANT_GEMV_MAX_ROWS = 8
# The static plan: Q8_0's tiled kernel up to this many rows, above it W8A8 on AVX-512 VNNI builds, else torch's fp32
# GEMM on the dequantized weight; int8's tiled kernel (builds without VNNI) up to INT8_TILED_MAX_ROWS.
QUANT_TILED_MAX_ROWS = 32
INT8_TILED_MAX_ROWS = 128
# The bands of row counts above QUANT_GEMV_MAX_ROWS measured apart: (first row, last row; None: no end).
QUANT_GEMM_BANDS: tuple[tuple[int, int | None], ...] = (
    (QUANT_GEMV_MAX_ROWS + 1, 16),
    (17, 32),
    (33, 64),
    (65, 128),
    (129, 256),
    (257, None),
)
INT8 = "int8"
# The types whose products quantize x per block (their GEMV is the integer product at any row count).
INTEGER_PRODUCT_TYPES = frozenset({"Q4_0", "Q4_K", "Q6_K"})
WEIGHT_TYPES = (INT8, "Q8_0", *sorted(INTEGER_PRODUCT_TYPES))

Band = tuple[int, "int | None", str]


@dataclass(frozen=True)
class KernelRows:
    """The rows one call of the extension's product covers for a weight type: up to `max_rows` rows (None: every
    M) the fused decode layer may run `ggml_linear` / `int8_linear` with `gemv_max_rows` (None: M itself, so the
    GEMV at every M) and computes what the per-op product computes; above `max_rows` the plan runs another product.
    """

    gemv_max_rows: int | None
    max_rows: int | None

    def gemv_rows_for(self, num_rows: int) -> int:
        """The `gemv_max_rows` the extension's product takes for `num_rows` rows."""
        return num_rows if self.gemv_max_rows is None else self.gemv_max_rows


@dataclass(frozen=True)
class QuantGemmPlan:
    """The product of each band of activation rows above `QUANT_GEMV_MAX_ROWS` for one weight type.

    Invariants: `bands` are `QUANT_GEMM_BANDS`, in order, each with its product (`GEMV`, `TILED`, `W8A8` or
    `DEQUANT`); `above_gemv` names what the extension's call runs above its `gemv_max_rows` for this type on this
    build (`W8A8` for int8 on AVX-512 VNNI builds, else `TILED`); `choices` holds the measured choices the plan came
    from, one per band (empty for the static plan).
    """

    weight_type: str
    bands: tuple[Band, ...]
    above_gemv: str = TILED
    choices: tuple[KernelChoice, ...] = ()

    def product_for(self, num_rows: int) -> str:
        """The product for `num_rows` activation rows (`GEMV` up to `QUANT_GEMV_MAX_ROWS`)."""
        if num_rows <= QUANT_GEMV_MAX_ROWS:
            return GEMV
        for _, last, product in self.bands:
            if last is None or num_rows <= last:
                return product
        raise AssertionError("the last band has no end")

    def kernel_rows(self) -> KernelRows:
        """The first stretch of bands one extension call with a fixed `gemv_max_rows` runs: the bands on `GEMV`
        from the first, then those on `above_gemv`; `max_rows` is where that stretch ends (None: never)."""
        gemv_last: int | None = QUANT_GEMV_MAX_ROWS
        index = 0
        while index < len(self.bands) and self.bands[index][2] == GEMV:
            gemv_last = self.bands[index][1]
            index += 1
        if index == len(self.bands):
            return KernelRows(gemv_max_rows=None, max_rows=None)
        last_row = gemv_last
        while index < len(self.bands) and self.bands[index][2] == self.above_gemv:
            last_row = self.bands[index][1]
            index += 1
        return KernelRows(
            gemv_max_rows=gemv_last, max_rows=None if index == len(self.bands) else last_row
        )

    def describe(self) -> str:
        """One line: each band's product and, where measured, the candidates' times."""
        return describe_bands(self.bands, self.choices)


def above_gemv_product(weight_type: str, w8a8_built: bool) -> str:
    """What the extension's product of `weight_type` runs above its `gemv_max_rows` (`QuantGemmPlan.above_gemv`)."""
    return W8A8 if weight_type == INT8 and w8a8_built else TILED


def static_quant_plan(weight_type: str, w8a8_built: bool) -> QuantGemmPlan:
    """The thresholds measured on Intel Xeons and an AVX2 EPYC, as a plan: Q4_0 / Q4_K / Q6_K the integer product
    at every M; Q8_0 the tiled kernel up to `QUANT_TILED_MAX_ROWS`, above it W8A8 (`w8a8_built`: AVX-512 VNNI) or
    the dequantized fp32 GEMM; int8 W8A8 above the GEMV where built, else the tiled kernel up to
    `INT8_TILED_MAX_ROWS` and the dequantized fp32 GEMM above. ValueError for an unknown type."""
    if weight_type in INTEGER_PRODUCT_TYPES:
        return _uniform(weight_type, lambda last: GEMV, w8a8_built)
    if weight_type == "Q8_0":
        large = W8A8 if w8a8_built else DEQUANT
        return _uniform(
            weight_type,
            lambda last: TILED if last is not None and last <= QUANT_TILED_MAX_ROWS else large,
            w8a8_built,
        )
    if weight_type == INT8:
        if w8a8_built:
            return _uniform(weight_type, lambda last: W8A8, w8a8_built)
        return _uniform(
            weight_type,
            lambda last: TILED if last is not None and last <= INT8_TILED_MAX_ROWS else DEQUANT,
            w8a8_built,
        )
    raise ValueError(f"unknown quantized weight type {weight_type!r} (known: {list(WEIGHT_TYPES)})")


def _uniform(
    weight_type: str, product_of: Callable[[int | None], str], w8a8_built: bool
) -> QuantGemmPlan:
    bands = tuple((first, last, product_of(last)) for first, last in QUANT_GEMM_BANDS)
    return QuantGemmPlan(weight_type, bands, above_gemv_product(weight_type, w8a8_built))


def w8a8_built() -> bool:
    """Whether the loaded extension has the W8A8 kernels (AVX-512 VNNI builds)."""
    ops = load_cpu_kernels()
    return ops is not None and bool(ops.has_w8a8_kernels())


def quant_gemm_choice() -> str:
    """`KVFLOW_QUANT_GEMM` ("auto" when unset); ValueError naming the variable for another value."""
    choice = os.environ.get(QUANT_GEMM_ENV, "").strip().lower() or "auto"
    if choice not in QUANT_GEMM_CHOICES:
        raise ValueError(
            f"{QUANT_GEMM_ENV}={choice!r} is not one of {', '.join(QUANT_GEMM_CHOICES)}"
        )
    return choice


def q8_0_activations() -> str:
    """`KVFLOW_Q8_0_ACTIVATIONS`: "int8" (unset or empty: the default; Q8_0 products quantize x per 32 elements,
    as Q4_0's do, and multiply integers) or "float32" (x kept in float32: Q8_0 products compute the dequantized
    float32 model's products); ValueError naming the variable for another value. The C++ kernels read the same
    variable at each call (csrc/kernels.h `q8_0_int8_activations`), so the per-op products, the fused decode layer
    and the measured plans follow one setting."""
    choice = os.environ.get(Q8_0_ACTIVATIONS_ENV, "").strip().lower() or "int8"
    if choice not in Q8_0_ACTIVATIONS_CHOICES:
        raise ValueError(
            f"{Q8_0_ACTIVATIONS_ENV}={choice!r} is not one of {', '.join(Q8_0_ACTIVATIONS_CHOICES)}"
        )
    return choice


_chosen_plans: dict[str, QuantGemmPlan] = {}


def quant_gemm_plan(weight_type: str) -> QuantGemmPlan:
    """The plan the quantized products of `weight_type` follow: the one a model measured in this process
    (`use_quant_gemm_plan`, only under "auto"), else the static plan."""
    chosen = _chosen_plans.get(weight_type)
    return chosen if chosen is not None else _static_plan(weight_type, w8a8_built())


@functools.cache
def _static_plan(weight_type: str, has_w8a8: bool) -> QuantGemmPlan:
    """`static_quant_plan`, kept per extension kind (the kernels switched off and on again in one process)."""
    return static_quant_plan(weight_type, has_w8a8)


def use_quant_gemm_plan(plan: QuantGemmPlan) -> None:
    """Make `plan` this process's plan for its weight type (the per-op products and, for layers built after, the
    fused decode layer's row limit follow it); `forget_quant_gemm_plans` drops it."""
    _chosen_plans[plan.weight_type] = plan


def forget_quant_gemm_plans() -> None:
    """Drop this process's measured plans and static plans (tests that switch the kernels or the variable)."""
    _chosen_plans.clear()
    _static_plan.cache_clear()
