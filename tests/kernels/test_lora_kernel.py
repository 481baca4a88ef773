"""The batched LoRA delta (`kvflow.lora.punica.lora_add`): the C++ kernel (csrc/lora.cpp) against the PyTorch
reference, the reference against a naive per-row loop, and the kernel's invariants.

The kernel runs as each variant: float32, and bfloat16 on each shrink product (`widened_fp32`, and `avx512_bf16`
where CPUID lists AVX512_BF16); `kernels.lora_add` runs the CPU's default one.

Invariants checked bitwise: rows with slot -1 keep their bits (NaN and inf included); a row's result is the same
alone, in any mixed batch (sub-batches of several sizes, a permuted order) and with one or two threads. Against the
reference the float32 sums run in another order: float32 agrees to float32 rounding, bfloat16 to one bfloat16 ulp
of the result (a float32 difference may move the final rounding by one ulp).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from itertools import pairwise
from pathlib import Path
from types import ModuleType

import pytest
import torch

from kvflow import kernels
from kvflow.kernels.build import KERNEL_CACHE_DIR_ENV, cpu_feature_flags
from kvflow.lora.punica import lora_add, lora_add_reference, slot_row_groups

DTYPES = [torch.float32, torch.bfloat16]
# (dtype, shrink product): the kernel's variants.
VARIANTS = [
    pytest.param((torch.float32, ""), id="float32"),
    pytest.param((torch.bfloat16, "widened_fp32"), id="bf16-widened_fp32"),
    pytest.param((torch.bfloat16, "avx512_bf16"), id="bf16-avx512_bf16"),
]
RANKS = [1, 8, 16, 64]
# Part sizes of packed layers, uneven and off the 16-lane width: o/down-like, gate_up-like, qkv-like.
PARTS = [(40,), (33, 17), (48, 16, 21)]
IN_FEATURES = 70
NUM_SLOTS = 5
# Slots 2 and 4 get no rows.
USED_SLOTS = (-1, 0, 1, 3)

LoraOperands = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int]
]


def make_operands(
    dtype: torch.dtype,
    num_rows: int,
    parts: Sequence[int],
    rank: int,
    seed: int,
    slot_choices: Sequence[int] = USED_SLOTS,
    in_features: int = IN_FEATURES,
) -> LoraOperands:
    """(y, x, lora_a, lora_b, token_slots int32, part_offsets) with random values and slots from `slot_choices`."""
    generator = torch.Generator().manual_seed(seed)
    offsets = [0]
    for size in parts:
        offsets.append(offsets[-1] + size)
    y = torch.randn(num_rows, offsets[-1], generator=generator).to(dtype)
    x = torch.randn(num_rows, in_features, generator=generator).to(dtype)
    lora_a = (torch.randn(NUM_SLOTS, len(parts) * rank, in_features, generator=generator) * 0.2).to(
        dtype
    )
    lora_b = (torch.randn(NUM_SLOTS, offsets[-1], rank, generator=generator) * 0.2).to(dtype)
    choices = torch.tensor(slot_choices, dtype=torch.int32)
    slots = choices[torch.randint(len(slot_choices), (num_rows,), generator=generator)]
    return y, x, lora_a, lora_b, slots, offsets


def naive_lora_add(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    part_offsets: Sequence[int],
) -> None:
    """The contract, one row and one part at a time."""
    rank = lora_b.shape[2]
    for row, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        for part, (low, high) in enumerate(pairwise(part_offsets)):
            t = lora_a[slot, part * rank : (part + 1) * rank].float() @ x[row].float()
            delta = lora_b[slot, low:high].float() @ t
            y[row, low:high] = (y[row, low:high].float() + delta).to(y.dtype)


def assert_close_to_rounding(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """float32: float32 rounding; bfloat16: at most one ulp of the expected value."""
    if expected.dtype is torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=1e-30)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (NaN compares equal to itself)."""
    return tensor.view(torch.int16 if tensor.dtype is torch.bfloat16 else torch.int32)


@pytest.fixture
def variant(ops: ModuleType, request: pytest.FixtureRequest) -> tuple[torch.dtype, str]:
    """(dtype, shrink) of a VARIANTS parameter, skipped where this build or CPU (CPUID) cannot run it."""
    dtype, shrink = request.param
    if shrink == "avx512_bf16" and not (ops.has_avx512() and ops.cpu_has_avx512_bf16()):
        pytest.skip("this build or CPU cannot run vdpbf16ps")
    return dtype, shrink


def run_kernel(ops: ModuleType, operands: LoraOperands, shrink: str = "") -> torch.Tensor:
    """A copy of y with the kernel's deltas added (`shrink`: the bfloat16 shrink product; empty: the default)."""
    y, x, lora_a, lora_b, slots, offsets = operands
    result = y.clone()
    ops.lora_add(result, x, lora_a, lora_b, slots, offsets, shrink)
    return result


@pytest.mark.parametrize("variant", VARIANTS, indirect=True)
@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("parts", PARTS)
@pytest.mark.parametrize("num_rows", [1, 7, 64, 300])
def test_kernel_matches_reference(
    ops: ModuleType,
    variant: tuple[torch.dtype, str],
    rank: int,
    parts: tuple[int, ...],
    num_rows: int,
) -> None:
    dtype, shrink = variant
    operands = make_operands(dtype, num_rows, parts, rank, seed=num_rows * 100 + rank)
    y, x, lora_a, lora_b, slots, offsets = operands
    expected = y.clone()
    lora_add_reference(expected, x, lora_a, lora_b, slots, offsets)
    actual = run_kernel(ops, operands, shrink)
    assert_close_to_rounding(actual, expected)
    unadapted = slots < 0
    assert torch.equal(bits(actual[unadapted]), bits(y[unadapted]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_dispatch_runs_the_default_kernel(ops: ModuleType, dtype: torch.dtype) -> None:
    operands = make_operands(dtype, 40, (48, 16, 21), 16, seed=4)
    y, x, lora_a, lora_b, slots, offsets = operands
    dispatched = y.clone()
    assert kernels.lora_add(dispatched, x, lora_a, lora_b, slots, offsets)
    assert torch.equal(bits(dispatched), bits(run_kernel(ops, operands, ops.default_lora_shrink())))
    assert ops.default_lora_shrink() in ("widened_fp32", "avx512_bf16")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_without_adapter_keep_their_bits(ops: ModuleType, dtype: torch.dtype) -> None:
    y, x, lora_a, lora_b, slots, offsets = make_operands(dtype, 50, (48, 16, 21), 16, seed=5)
    y[::3, ::7] = float("nan")
    y[1::3, ::5] = float("inf")
    slots[::3] = -1
    slots[1::3] = -1
    unadapted = slots < 0
    for add in (kernels.lora_add, lora_add_reference):
        result = y.clone()
        add(result, x, lora_a, lora_b, slots, offsets)
        assert torch.equal(bits(result[unadapted]), bits(y[unadapted]))
        assert not torch.equal(bits(result[~unadapted]), bits(y[~unadapted]))
        untouched = y.clone()
        add(untouched, x, lora_a, lora_b, torch.full_like(slots, -1), offsets)
        assert torch.equal(bits(untouched), bits(y))


@pytest.mark.parametrize("variant", VARIANTS, indirect=True)
@pytest.mark.parametrize("rank", [16, 64])
def test_row_alone_equals_row_in_any_batch_and_thread_count(
    ops: ModuleType, variant: tuple[torch.dtype, str], rank: int
) -> None:
    dtype, shrink = variant
    num_rows = 300
    # Slot 0 gets most rows (groups of hundreds: many row tiles), the others a few. 512 inputs: the whole batch is
    # past the kernel's parallel threshold (2^22 multiply-adds), a row alone or a small batch is below it.
    y, x, lora_a, lora_b, slots, offsets = make_operands(
        dtype,
        num_rows,
        (48, 16, 21),
        rank,
        seed=rank,
        slot_choices=(0, 0, 0, 0, 1, 3, -1),
        in_features=512,
    )
    alone = torch.cat(
        [
            run_kernel(
                ops, (y[i : i + 1], x[i : i + 1], lora_a, lora_b, slots[i : i + 1], offsets), shrink
            )
            for i in range(num_rows)
        ]
    )
    permutation = torch.randperm(num_rows, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            assert torch.equal(
                bits(run_kernel(ops, (y, x, lora_a, lora_b, slots, offsets), shrink)), bits(alone)
            )
            for batch_size in (2, 5, 37):
                for start in range(0, num_rows, batch_size):
                    rows = permutation[start : start + batch_size]
                    batch = (y[rows], x[rows], lora_a, lora_b, slots[rows], offsets)
                    assert torch.equal(bits(run_kernel(ops, batch, shrink)), bits(alone[rows]))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_of_a_wider_buffer_and_int64_slots(ops: ModuleType, dtype: torch.dtype) -> None:
    """y and x may be column slices of wider buffers (rows contiguous, not the tensor); int64 slots and a tensor of
    part offsets are accepted."""
    y, x, lora_a, lora_b, slots, offsets = make_operands(dtype, 20, (33, 17), 8, seed=9)
    expected = y.clone()
    lora_add_reference(expected, x, lora_a, lora_b, slots, offsets)
    wide_y = torch.zeros(20, y.shape[1] + 9, dtype=dtype)
    wide_y[:, 4 : 4 + y.shape[1]] = y
    wide_x = torch.zeros(20, IN_FEATURES + 3, dtype=dtype)
    wide_x[:, 3:] = x
    y_view = wide_y[:, 4 : 4 + y.shape[1]]
    assert kernels.lora_add(
        y_view, wide_x[:, 3:], lora_a, lora_b, slots.to(torch.int64), torch.tensor(offsets)
    )
    assert_close_to_rounding(y_view, expected)
    assert not wide_y[:, :4].any() and not wide_y[:, 4 + y.shape[1] :].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("parts", PARTS)
def test_reference_matches_naive_loop(dtype: torch.dtype, parts: tuple[int, ...]) -> None:
    y, x, lora_a, lora_b, slots, offsets = make_operands(dtype, 64, parts, 16, seed=len(parts))
    expected = y.clone()
    naive_lora_add(expected, x, lora_a, lora_b, slots, offsets)
    grouped = y.clone()
    lora_add_reference(grouped, x, lora_a, lora_b, slots, offsets)
    assert_close_to_rounding(grouped, expected)
    regrouped = y.clone()
    lora_add_reference(
        regrouped, x, lora_a, lora_b, slots, offsets, row_groups=slot_row_groups(slots)
    )
    assert torch.equal(bits(regrouped), bits(grouped))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fallback_with_kernels_off_is_the_reference(kernels_off: None, dtype: torch.dtype) -> None:
    y, x, lora_a, lora_b, slots, offsets = make_operands(dtype, 30, (48, 16, 21), 8, seed=11)
    assert not kernels.lora_add(y.clone(), x, lora_a, lora_b, slots, offsets)
    expected = y.clone()
    naive_lora_add(expected, x, lora_a, lora_b, slots, offsets)
    actual = y.clone()
    lora_add(actual, x, lora_a, lora_b, slots, offsets)
    assert_close_to_rounding(actual, expected)
    reference = y.clone()
    lora_add_reference(reference, x, lora_a, lora_b, slots, offsets)
    assert torch.equal(bits(actual), bits(reference))


def test_unsupported_dtype_is_not_for_the_kernel(ops: ModuleType) -> None:
    y, x, lora_a, lora_b, slots, offsets = make_operands(torch.float64, 4, (40,), 4, seed=1)
    assert not kernels.lora_add(y, x, lora_a, lora_b, slots, offsets)


def _bad(operands: LoraOperands, **changes: object) -> LoraOperands:
    y, x, lora_a, lora_b, slots, offsets = operands
    values = {
        "y": y,
        "x": x,
        "lora_a": lora_a,
        "lora_b": lora_b,
        "slots": slots,
        "offsets": offsets,
    }
    values.update(changes)
    return tuple(values.values())  # type: ignore[return-value]


BAD_INPUTS: list[tuple[str, Callable[[LoraOperands], LoraOperands]]] = [
    ("x", lambda o: _bad(o, x=o[1].double())),
    ("x", lambda o: _bad(o, x=o[1][:3])),
    ("lora_a", lambda o: _bad(o, lora_a=o[2][:, :-1])),
    ("lora_a", lambda o: _bad(o, lora_a=o[2].bfloat16())),
    ("lora_b", lambda o: _bad(o, lora_b=o[3][:, :-1])),
    ("token_slots", lambda o: _bad(o, slots=o[4][:-1])),
    ("token_slots", lambda o: _bad(o, slots=torch.full_like(o[4], NUM_SLOTS))),
    ("token_slots", lambda o: _bad(o, slots=torch.full_like(o[4], -2))),
    ("part_offsets", lambda o: _bad(o, offsets=[0, 40, 30, 81])),
    ("part_offsets", lambda o: _bad(o, offsets=[0, 33, 80])),
]


@pytest.mark.parametrize(("argument", "make_bad"), BAD_INPUTS)
def test_bad_inputs_name_the_argument(
    ops: ModuleType, argument: str, make_bad: Callable[[LoraOperands], LoraOperands]
) -> None:
    y, x, lora_a, lora_b, slots, offsets = make_bad(
        make_operands(torch.float32, 8, (33, 17, 31), 4, seed=2)
    )
    original = y.clone()
    for add in (lora_add, lora_add_reference):
        with pytest.raises((RuntimeError, ValueError), match=argument):
            add(y, x, lora_a, lora_b, slots, offsets)
        assert torch.equal(y, original)


# Patches the build flags before anything loads the extension, checks it is the portable build, runs this file.
_PORTABLE_RUNNER = """
import sys
import kvflow.kernels.build as build
build._CFLAGS = build._CFLAGS + ("-mno-avx512f",)
ops = build.load_cpu_kernels()
assert ops is not None and not ops.has_avx512(), "not a build without AVX-512"
import pytest
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
"""


@pytest.mark.slow
def test_the_build_without_avx512_passes_these_tests(tmp_path: Path) -> None:
    """The kernel's portable code (what a CPU without AVX-512 builds) against the same tests, in a subprocess with its
    own build (one more compile)."""
    if "avx512f" not in cpu_feature_flags():
        pytest.skip("this CPU has no AVX-512: the suite's own build already runs the portable code")
    if kernels.load_cpu_kernels() is None:
        pytest.skip("the CPU kernels are off or cannot be built here")
    completed = subprocess.run(
        [sys.executable, "-c", _PORTABLE_RUNNER, __file__, "-m", "not slow"],
        env={**os.environ, KERNEL_CACHE_DIR_ENV: str(tmp_path / "kernels")},
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-4000:]
    assert " passed" in output and "failed" not in output, output[-2000:]
