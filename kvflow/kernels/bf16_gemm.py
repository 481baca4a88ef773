"""Which product bfloat16 layers run above `MAX_GEMV_ROWS` rows, by band of row counts, chosen by measurement.

Candidates: torch's `F.linear` (oneDNN) and each of kvflow's GEMM kernels this CPU runs (`widened_fp32` on any
AVX-512 build, `avx512_bf16` with AVX512_BF16 in CPUID, `amx_bf16` where AMX is usable). With `KVFLOW_BF16_GEMM`
unset or "auto", the first bfloat16 model built in a process times them for each band (`BF16_GEMM_BANDS`) on that
model's layer shapes (`KernelChoices`: a few ms per candidate, cached per CPU model and kernel build, so later
processes read the choice) and `kernels.linear` follows the result (`Bf16GemmPlan`). `KVFLOW_BF16_GEMM=torch` or a
kernel's name runs that one for every band, measuring nothing. Before a model has chosen (a kernel called directly),
the plan is the CPU's static default: `default_gemm_kernel` for every band where `gemm_kernel_wins`.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvflow.kernels.build import (
    CPU_KERNELS_ENV,
    cpu_feature_flags,
    extension_name,
    kernels_build_dir,
    load_cpu_kernels,
)
from kvflow.kernels.choice import (
    CHOICES_FILE,
    KernelChoice,
    KernelChoices,
    cpu_model_name,
    describe_bands,
)

logger = logging.getLogger(__name__)

# Up to this many rows the GEMV kernel beats torch's GEMM for the decode shapes (benchmarks/cpu_kernels.py).
MAX_GEMV_ROWS = 8
# The GEMM kernels' instruction set.
_GEMM_REQUIRED_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl"})
# `KVFLOW_BF16_GEMM`: which product bfloat16 layers run above MAX_GEMV_ROWS rows. "auto" (the default): chosen by
# measurement (this module's docstring); "torch": F.linear (oneDNN); else one kernel by name.
BF16_GEMM_ENV = "KVFLOW_BF16_GEMM"
BF16_GEMM_CHOICES = ("auto", "torch", "widened_fp32", "avx512_bf16", "amx_bf16")
TORCH = "torch"
# The bands of row counts above MAX_GEMV_ROWS measured apart: (first row, last row; None: no end). Each is timed at
# its last row (the open band at `_OPEN_BAND_ROWS`).
BF16_GEMM_BANDS: tuple[tuple[int, int | None], ...] = (
    (MAX_GEMV_ROWS + 1, 16),
    (17, 32),
    (33, 64),
    (65, 128),
    (129, 256),
    (257, None),
)
_OPEN_BAND_ROWS = 512
# A timed product does at most about this many multiply-adds (its weight cut to fewer output rows if needed, never
# below `_MIN_TIMED_OUTPUTS`): a few ms per candidate, whatever the model's size.
_TIMED_MACS = 128 * 1024 * 1024
_MIN_TIMED_OUTPUTS = 256


@dataclass(frozen=True)
class Bf16GemmPlan:
    """The product for each band of row counts above `MAX_GEMV_ROWS`: a kernel's name, or None for torch.

    Invariants: `bands` are `BF16_GEMM_BANDS`, in order, each with its product; `choices` holds the measured
    choices the plan came from (empty for a static or forced plan).
    """

    bands: tuple[tuple[int, int | None, str | None], ...]
    choices: tuple[KernelChoice, ...] = ()

    @classmethod
    def uniform(cls, kernel: str | None) -> Bf16GemmPlan:
        """One product for every band."""
        return cls(tuple((first, last, kernel) for first, last in BF16_GEMM_BANDS))

    def kernel_for(self, num_rows: int) -> str | None:
        """The product for `num_rows` (> MAX_GEMV_ROWS) rows: a kernel's name, or None for torch."""
        for _, last, kernel in self.bands:
            if last is None or num_rows <= last:
                return kernel
        raise AssertionError("the last band has no end")

    def first_kernel_rows(self) -> tuple[str | None, int | None]:
        """The product of the first band and the last row of the run of bands after it with that same product
        (None: every row count). The fused decode layer runs its dense products on this kernel up to those rows."""
        kernel = self.bands[0][2]
        last_row: int | None = self.bands[0][1]
        for _, last, band_kernel in self.bands[1:]:
            if band_kernel != kernel:
                return kernel, last_row
            last_row = last
        return kernel, last_row

    def describe(self) -> str:
        """One line: each band's product and, where measured, the candidates' times."""
        return describe_bands(
            [(first, last, kernel or TORCH) for first, last, kernel in self.bands], self.choices
        )


def gemm_kernel_wins(flags: Collection[str]) -> bool:
    """Whether kvflow's bf16 GEMM kernels are candidates on a CPU with these feature flags: every AVX-512 (F, BW,
    VL) CPU. Without AVX-512 torch's F.linear runs every band."""
    return set(flags) >= _GEMM_REQUIRED_FLAGS


@functools.cache
def bf16_gemm_kernel() -> str | None:
    """The static or forced kernel for bfloat16 products of more than `MAX_GEMV_ROWS` rows: "widened_fp32",
    "avx512_bf16" or "amx_bf16"; None for torch's F.linear. Under "auto" this is the CPU's default kernel (what runs
    before a model measured its plan, `choose_bf16_gemm_plan`).

    `KVFLOW_BF16_GEMM` forces one (`BF16_GEMM_CHOICES`). Raises ValueError naming the variable for an unknown value,
    or for a kernel this process cannot run (no AVX-512 build, CPU kernels off, AVX512_BF16 missing from CPUID, AMX
    missing or its tile permission refused).
    """
    choice = _env_choice()
    if choice == TORCH:
        return None
    ops = load_cpu_kernels()
    if ops is None or not ops.has_avx512() or not gemm_kernel_wins(cpu_feature_flags()):
        if choice == "auto":
            return None
        raise ValueError(
            f"{BF16_GEMM_ENV}={choice}: kvflow's GEMM kernels need the CPU kernels "
            f"({CPU_KERNELS_ENV} on) on an AVX-512 (F, BW, VL) CPU"
        )
    if choice == "auto":
        choice = str(ops.default_gemm_kernel())
    if choice not in runnable_gemm_kernels():
        raise ValueError(
            f"{BF16_GEMM_ENV}={choice}: this CPU cannot run it "
            + (
                "(no AVX512_BF16 in CPUID)"
                if choice == "avx512_bf16"
                else "(no AMX in CPUID, or the kernel refused this process the tile state)"
            )
        )
    ops.set_gemm_kernel(choice)
    return choice


def runnable_gemm_kernels() -> tuple[str, ...]:
    """kvflow's GEMM kernels this process can run (empty without the AVX-512 kernels)."""
    ops = load_cpu_kernels()
    if ops is None or not ops.has_avx512() or not gemm_kernel_wins(cpu_feature_flags()):
        return ()
    runnable = ["widened_fp32"]
    if ops.cpu_has_avx512_bf16():
        runnable.append("avx512_bf16")
    if ops.amx_usable():
        runnable.append("amx_bf16")
    return tuple(runnable)


_chosen_plan: Bf16GemmPlan | None = None


def bf16_gemm_plan() -> Bf16GemmPlan:
    """The plan `kernels.linear` follows: the one a model measured in this process (`choose_bf16_gemm_plan`, only
    under "auto"), else `bf16_gemm_kernel`'s forced or static kernel for every band."""
    return _chosen_plan if _chosen_plan is not None else _static_plan()


@functools.cache
def _static_plan() -> Bf16GemmPlan:
    return Bf16GemmPlan.uniform(bf16_gemm_kernel())


def forget_bf16_gemm_plan() -> None:
    """Drop this process's measured plan and static choice (tests that switch the kernels or the variable)."""
    global _chosen_plan
    _chosen_plan = None
    _static_plan.cache_clear()
    bf16_gemm_kernel.cache_clear()


def choose_bf16_gemm_plan(
    shapes: Iterable[tuple[int, int]],
    *,
    choices: KernelChoices | None = None,
    extra_candidates: dict[str, Callable[[torch.Tensor, torch.Tensor], object]] | None = None,
) -> Bf16GemmPlan:
    """Measure (or read the cached choice of) the product for each band on weights of `shapes` ([out, in] of a
    layer's distinct bfloat16 products), make it this process's plan, and log it once.

    Under a forced `KVFLOW_BF16_GEMM`, or without kvflow's GEMM kernels, nothing is measured (the plan is
    `bf16_gemm_plan()`'s). `choices` defaults to the machine's cache next to the compiled kernels;
    `extra_candidates` (tests: a deliberately slowed kernel) compete as well, each a function of (x, weight), and
    win nothing in `kernels.linear` unless named by a later plan.
    """
    bf16_gemm_kernel()  # a bad KVFLOW_BF16_GEMM fails here
    kernels = runnable_gemm_kernels()
    distinct = sorted(set(shapes))
    if _env_choice() != "auto" or not kernels or not distinct:
        return bf16_gemm_plan()
    if choices is None:
        choices = KernelChoices(default_choices_path())
    ops = load_cpu_kernels()
    assert ops is not None
    band_choices = []
    for first, last in BF16_GEMM_BANDS:
        rows = last if last is not None else _OPEN_BAND_ROWS
        operands = _timed_operands(distinct, rows)
        candidates: dict[str, Callable[[], object]] = {
            TORCH: _each(operands, lambda x, w: F.linear(x, w)),
        }
        for kernel in kernels:
            candidates[kernel] = _each(
                operands, lambda x, w, kernel=kernel: ops.gemm_with(x, w, None, False, kernel)
            )
        for name, product in (extra_candidates or {}).items():
            candidates[name] = _each(operands, product)
        key = _choice_key(first, last, rows, operands)
        band_choices.append(choices.choose(key, candidates))
    plan = Bf16GemmPlan(
        tuple(
            (first, last, None if choice.kernel == TORCH else choice.kernel)
            for (first, last), choice in zip(BF16_GEMM_BANDS, band_choices, strict=True)
        ),
        tuple(band_choices),
    )
    if plan != _chosen_plan:
        logger.info(
            "bfloat16 products above %d rows, chosen by measurement on %s with %d threads: %s",
            MAX_GEMV_ROWS,
            ", ".join(f"{n}x{k}" for n, k in distinct),
            torch.get_num_threads(),
            plan.describe(),
        )
    use_bf16_gemm_plan(plan)
    return plan


def use_bf16_gemm_plan(plan: Bf16GemmPlan) -> None:
    """Make `plan` this process's plan: `kernels.linear` follows it, and the fused decode layer's dense products
    (the extension's `gemm_kernel`) run on its first band's kernel. The caller checked the CPU runs its kernels.
    A forced `KVFLOW_BF16_GEMM` does not replace it; `forget_bf16_gemm_plan` does."""
    global _chosen_plan
    _chosen_plan = plan
    first_kernel = plan.bands[0][2]
    ops = load_cpu_kernels()
    if first_kernel is not None and ops is not None:
        ops.set_gemm_kernel(first_kernel)


def _env_choice() -> str:
    choice = os.environ.get(BF16_GEMM_ENV, "").strip().lower() or "auto"
    if choice not in BF16_GEMM_CHOICES:
        raise ValueError(f"{BF16_GEMM_ENV}={choice!r} is not one of {', '.join(BF16_GEMM_CHOICES)}")
    return choice


def _timed_operands(
    shapes: Sequence[tuple[int, int]], rows: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(x [rows, in], weight [out', in]) per shape, bfloat16, seeded: `out'` cut so one product stays near
    `_TIMED_MACS` (a multiple of 64, at least `_MIN_TIMED_OUTPUTS`, at most the layer's)."""
    generator = torch.Generator().manual_seed(0)
    operands = []
    for out_features, in_features in shapes:
        budget = _TIMED_MACS // max(1, rows * in_features)
        timed_out = min(out_features, max(_MIN_TIMED_OUTPUTS, budget // 64 * 64))
        x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
        weight = torch.randn(timed_out, in_features, generator=generator).to(torch.bfloat16)
        operands.append((x, weight))
    return operands


def _each(
    operands: list[tuple[torch.Tensor, torch.Tensor]],
    product: Callable[[torch.Tensor, torch.Tensor], object],
) -> Callable[[], object]:
    def run() -> None:
        for x, weight in operands:
            product(x, weight)

    return run


def _choice_key(
    first: int, last: int | None, rows: int, operands: list[tuple[torch.Tensor, torch.Tensor]]
) -> str:
    band = f"{first}-{last}" if last is not None else f"{first}+"
    timed = ",".join(f"{w.shape[0]}x{w.shape[1]}" for _, w in operands)
    return (
        f"bf16_gemm rows {band} (timed at {rows}) shapes {timed} threads {torch.get_num_threads()} "
        f"cpu {cpu_model_name()!r}"
    )


def default_choices_path() -> Path:
    """Where measured choices are kept on this machine: beside the compiled kernels."""
    return kernels_build_dir() / extension_name() / CHOICES_FILE
