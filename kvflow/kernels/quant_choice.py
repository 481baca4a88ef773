"""Measuring each quantized weight type's plan (`quant_plan.QuantGemmPlan`) on a model's own layer shapes.

With `KVFLOW_QUANT_GEMM` unset or "auto", a quantization plan that knows its layers' shapes (int8 at `apply`, a GGUF
file's runs) calls `choose_quant_gemm_plans` before the model picks its fast paths: for each weight type and each
band of `QUANT_GEMM_BANDS`, every product this build runs for that type (`candidate_products`) is timed on
synthetic weights of those shapes at the band's last row count (`KernelChoices`: a few ms each, cached beside the
compiled kernels per CPU model, build, shapes, activation dtype, thread count and, for Q8_0,
`KVFLOW_Q8_0_ACTIVATIONS` (the products run on whichever activations it sets), so later processes read the
choice), and the fastest becomes the band's product, unless the static plan's product measured within
`KEEP_STATIC_WITHIN` of it (`band_product`). The plan is logged once at INFO and made the process's plan for
that type, which the per-op products and the fused decode layer's row limit then follow. "static" keeps the static
plan and measures nothing.

Candidates per type: the GEMV (Q4_0 / Q4_K / Q6_K: the integer product, at every band; Q8_0 and int8: up to
`_STREAMING_MAX_ROWS` rows, its cost growing with M), the extension's product above its GEMV rows (the tiled
kernel, or for int8 on AVX-512 VNNI builds W8A8), Q8_0's W8A8 (VNNI builds) above `QUANT_TILED_MAX_ROWS` only, so that
Q8_0's small batches keep their activations whatever is measured (quantized per 32 by default, as its decode GEMV's;
float32, exact against the float32 model, under `KVFLOW_Q8_0_ACTIVATIONS=float32`), and above `_STREAMING_MAX_ROWS`
rows the dequantized fp32 GEMM.
Mixture-of-experts experts keep the static thresholds (`quant.fused_moe`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from kvflow.kernels import quant
from kvflow.kernels.bf16_gemm import default_choices_path
from kvflow.kernels.choice import KernelChoice, KernelChoices, cpu_model_name
from kvflow.kernels.quant_plan import (
    DEQUANT,
    GEMV,
    INT8,
    INTEGER_PRODUCT_TYPES,
    QUANT_GEMM_BANDS,
    QUANT_GEMV_MAX_ROWS,
    QUANT_TILED_MAX_ROWS,
    W8A8,
    QuantGemmPlan,
    above_gemv_product,
    q8_0_activations,
    quant_gemm_choice,
    quant_gemm_plan,
    static_quant_plan,
    use_quant_gemm_plan,
    w8a8_built,
)

logger = logging.getLogger(__name__)

# Each band is timed at its last row (the open band at `_OPEN_BAND_ROWS`).
_OPEN_BAND_ROWS = 512
# Up to this many rows (the fused decode layer's most) the products are bound by the weights' bytes: Q8_0's and
# int8's GEMV compete there (its cost grows with M above), the dequantized fp32 GEMM only above. It writes a float32
# copy of the weight and reads it back, ~8x the bytes of streaming Q8_0 blocks once, and on weights cut to the
# timing budget that copy stays in cache and looks cheaper than it is: Q8_0 at 16 rows on Llama-3.2-1B's layers
# measured 1.28x the GEMV's time on weights cut to 128M multiply-adds, 3.9x on the whole weights (Zen 4, 1 thread).
_STREAMING_MAX_ROWS = 64
# A timed product does at most about this many multiply-adds (its weight cut to fewer output rows if needed, never
# below `_MIN_TIMED_OUTPUTS`): a few ms per candidate, whatever the model's size.
_TIMED_MACS = 128 * 1024 * 1024
_MIN_TIMED_OUTPUTS = 256
# A band keeps the static plan's product unless another one measured more than this much faster: a tie measured on
# a busy machine (Q8_0 at 9-16 rows on Zen 4: GEMV 9.75, tiled 9.90 ms) does not move a threshold chosen on purpose.
KEEP_STATIC_WITHIN = 0.05
# A product whose best of two timed rounds is more than this many times the fastest one's runs no more rounds (the
# tiled fp32 kernel at prefill sizes costs 4-5x the integer product: most of the measuring time otherwise).
_DROP_RATIO = 4.0


@dataclass(frozen=True)
class TimedWeight:
    """A synthetic weight of one layer shape: GGUF blocks `[rows, row_bytes]` (valid fp16 scales, random quants) or
    int8 `[rows, columns]` with a float32 `scale` per row (None for GGUF types)."""

    data: torch.Tensor
    scale: torch.Tensor | None


# A timed product: x [M, K] against one weight.
Product = Callable[[torch.Tensor, TimedWeight], object]


def candidate_products(weight_type: str, last_row: int | None) -> tuple[str, ...]:
    """The products that compete for the band ending at `last_row` (None: open) of `weight_type` on this build."""
    has_w8a8 = w8a8_built()
    streaming = last_row is not None and last_row <= _STREAMING_MAX_ROWS
    products = []
    if weight_type in INTEGER_PRODUCT_TYPES or streaming:
        products.append(GEMV)
    products.append(above_gemv_product(weight_type, has_w8a8))
    if weight_type == "Q8_0" and has_w8a8 and (last_row is None or last_row > QUANT_TILED_MAX_ROWS):
        products.append(W8A8)
    if not streaming:
        products.append(DEQUANT)
    return tuple(products)


def choose_quant_gemm_plans(
    shapes_by_type: Mapping[str, Iterable[tuple[int, int]]],
    *,
    dtype: torch.dtype = torch.float32,
    choices: KernelChoices | None = None,
    extra_candidates: Mapping[str, Mapping[str, Product]] | None = None,
) -> dict[str, QuantGemmPlan]:
    """Measure (or read the cached choice of) each band's product for each weight type on synthetic weights of its
    `[out, in]` shapes and x in `dtype`, make each plan this process's, and log each once. Returns the plans.

    Under `KVFLOW_QUANT_GEMM=static`, or without the C++ kernels, nothing is measured (each plan is the process's
    current one). `choices` defaults to the machine's cache beside the compiled kernels; `extra_candidates` (tests:
    a deliberately slowed product), by weight type, compete as well and win nothing in the products unless named
    by a later plan.
    """
    measure = quant_gemm_choice() == "auto" and quant.kernels_in_use()
    plans = {}
    for weight_type, shapes in sorted(shapes_by_type.items()):
        distinct = sorted(set(shapes))
        if not measure or not distinct:
            plans[weight_type] = quant_gemm_plan(weight_type)
            continue
        if choices is None:
            choices = KernelChoices(default_choices_path())
        extra = (extra_candidates or {}).get(weight_type, {})
        plans[weight_type] = _measure_plan(weight_type, distinct, dtype, choices, extra)
    return plans


def activation_dtype(model: torch.nn.Module) -> torch.dtype:
    """The activations' dtype of a model (its `dtype`; float32 for a module without one): what its plans are
    measured with."""
    dtype = getattr(model, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def _measure_plan(
    weight_type: str,
    shapes: Sequence[tuple[int, int]],
    dtype: torch.dtype,
    choices: KernelChoices,
    extra: Mapping[str, Product],
) -> QuantGemmPlan:
    band_choices: list[KernelChoice] = []
    for first, last in QUANT_GEMM_BANDS:
        rows = last if last is not None else _OPEN_BAND_ROWS
        timed_shapes = _timed_shapes(shapes, rows)
        # Made on the first timed call only: a cached choice costs no synthetic weights.
        operands = functools.cache(
            functools.partial(_timed_operands, weight_type, timed_shapes, rows, dtype)
        )
        candidates = {
            product: _each(operands, _product_of(weight_type, product))
            for product in candidate_products(weight_type, last)
        }
        for name, product in extra.items():
            candidates[name] = _each(operands, product)
        key = _choice_key(weight_type, first, last, rows, dtype, timed_shapes)
        band_choices.append(choices.choose(key, candidates, drop_ratio=_DROP_RATIO))
    static = static_quant_plan(weight_type, w8a8_built())
    plan = QuantGemmPlan(
        weight_type,
        tuple(
            (first, last, band_product(choice, static_product))
            for (first, last, static_product), choice in zip(
                static.bands, band_choices, strict=True
            )
        ),
        static.above_gemv,
        tuple(band_choices),
    )
    if plan != quant_gemm_plan(weight_type):
        logger.info(
            "%s products above %d rows, chosen by measurement on %s (%s x) with %d threads: %s",
            weight_type,
            QUANT_GEMV_MAX_ROWS,
            ", ".join(f"{n}x{k}" for n, k in shapes),
            str(dtype).removeprefix("torch."),
            torch.get_num_threads(),
            plan.describe(),
        )
    use_quant_gemm_plan(plan)
    return plan


def band_product(choice: KernelChoice, static_product: str) -> str:
    """The product a band runs: the measured fastest, unless the static plan's product measured within
    `KEEP_STATIC_WITHIN` of it (then that one; the same answer in every process reading the same choice)."""
    static_ms = choice.times_ms.get(static_product, float("inf"))
    fastest_ms = choice.times_ms.get(choice.kernel, 0.0)
    return static_product if static_ms <= (1.0 + KEEP_STATIC_WITHIN) * fastest_ms else choice.kernel


def _product_of(weight_type: str, product: str) -> Product:
    def run(x: torch.Tensor, weight: TimedWeight) -> object:
        return quant.run_product(weight_type, product, x, weight.data, weight.scale)

    return run


def synthetic_weight(
    weight_type: str, rows: int, columns: int, generator: torch.Generator
) -> TimedWeight:
    """Random quants of `weight_type` `[rows, columns]` with valid scales: what the products' speed depends on (the
    kernels take no data-dependent branches)."""
    if weight_type == INT8:
        qweight = torch.randint(-127, 128, (rows, columns), generator=generator, dtype=torch.int8)
        return TimedWeight(qweight, torch.rand(rows, generator=generator) * 0.01 + 1e-3)
    blocks = torch.randint(
        0,
        256,
        (rows, quant.ggml_row_bytes(weight_type, columns)),
        generator=generator,
        dtype=torch.uint8,
    )
    block_elements, block_bytes = quant.GGML_BLOCK_SIZES[weight_type]
    per_block = blocks.view(rows, columns // block_elements, block_bytes)
    scale_bytes = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    for offset in _FP16_FIELDS[weight_type]:
        per_block[..., offset : offset + 2] = scale_bytes
    return TimedWeight(blocks, None)


# The byte offsets of each block's fp16 scales (d, and Q4_K's dmin), set to a finite value in synthetic blocks.
_FP16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}


def _timed_shapes(shapes: Sequence[tuple[int, int]], rows: int) -> list[tuple[int, int]]:
    """[out', in] per layer shape: `out'` cut so one product of `rows` rows stays near `_TIMED_MACS` (a multiple of
    64, at least `_MIN_TIMED_OUTPUTS`, at most the layer's)."""
    timed = []
    for out_features, in_features in shapes:
        budget = _TIMED_MACS // max(1, rows * in_features)
        timed.append((min(out_features, max(_MIN_TIMED_OUTPUTS, budget // 64 * 64)), in_features))
    return timed


def _timed_operands(
    weight_type: str, timed_shapes: Sequence[tuple[int, int]], rows: int, dtype: torch.dtype
) -> list[tuple[torch.Tensor, TimedWeight]]:
    """(x [rows, in] in `dtype`, a synthetic weight [out', in]) per timed shape, seeded."""
    generator = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(rows, in_features, generator=generator).to(dtype),
            synthetic_weight(weight_type, out_features, in_features, generator),
        )
        for out_features, in_features in timed_shapes
    ]


def _each(
    operands: Callable[[], list[tuple[torch.Tensor, TimedWeight]]], product: Product
) -> Callable[[], object]:
    def run() -> None:
        for x, weight in operands():
            product(x, weight)

    return run


def _choice_key(
    weight_type: str,
    first: int,
    last: int | None,
    rows: int,
    dtype: torch.dtype,
    timed_shapes: Sequence[tuple[int, int]],
) -> str:
    band = f"{first}-{last}" if last is not None else f"{first}+"
    activations = f" activations {q8_0_activations()}" if weight_type == "Q8_0" else ""
    timed = ",".join(f"{out_features}x{in_features}" for out_features, in_features in timed_shapes)
    return (
        f"quant_gemm {weight_type}{activations} rows {band} (timed at {rows}) {str(dtype).removeprefix('torch.')} x "
        f"shapes {timed} threads {torch.get_num_threads()} cpu {cpu_model_name()!r}"
    )
