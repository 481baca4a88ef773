"""Kernels chosen by measurement (`kvflow.kernels.choice`, `kvflow.kernels.bf16_gemm`): a choice is made, cached
per machine and kernel build, read back by later processes, overridden by `KVFLOW_BF16_GEMM`, and a deliberately
slowed candidate is never chosen while a faster one exists."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from kvflow import kernels
from kvflow.kernels.bf16_gemm import BF16_GEMM_BANDS, TORCH, runnable_gemm_kernels
from kvflow.kernels.choice import KernelChoices, time_candidates

# A layer's [out, in] shapes, small enough to time in a few ms per band on 2 cores.
SHAPES = [(384, 256), (256, 256), (1024, 256), (256, 512)]


def _work(size: int = 96) -> Callable[[], object]:
    a = torch.randn(size, size)
    return lambda: a @ a


def _slowed(product: Callable[[], object], times: int = 4) -> Callable[[], object]:
    """The same product `times` times over: slower than the original on any machine, however busy."""

    def run() -> None:
        for _ in range(times):
            product()

    return run


@pytest.fixture
def clean_plan() -> Iterator[None]:
    kernels.forget_bf16_gemm_plan()
    yield
    kernels.forget_bf16_gemm_plan()


def test_time_candidates_runs_each_candidate_once_to_warm_up_then_once_per_round() -> None:
    calls = {"a": 0, "b": 0}

    def counting(name: str) -> Callable[[], None]:
        def run() -> None:
            calls[name] += 1

        return run

    times = time_candidates({"a": counting("a"), "b": counting("b")}, rounds=3)
    assert calls == {"a": 4, "b": 4}
    assert set(times) == {"a", "b"} and all(t >= 0 for t in times.values())
    with pytest.raises(ValueError, match="at least one candidate"):
        time_candidates({})


def test_a_slowed_candidate_is_never_chosen_and_the_choice_is_cached(tmp_path: Path) -> None:
    fast = _work()
    path = tmp_path / "choices.json"
    choice = KernelChoices(path).choose("product", {"slowed": _slowed(fast), "fast": fast})
    assert choice.kernel == "fast" and choice.source == "measured"
    assert choice.times_ms["fast"] < choice.times_ms["slowed"]
    saved = json.loads(path.read_text())
    assert saved["product"]["kernel"] == "fast"

    def must_not_run() -> None:
        raise AssertionError("a cached choice is measured again")

    again = KernelChoices(path).choose("product", {"slowed": must_not_run, "fast": must_not_run})
    assert (again.kernel, again.source) == ("fast", "cached")
    assert again.times_ms == pytest.approx(choice.times_ms, abs=1e-3)


def test_a_cached_kernel_that_is_no_longer_a_candidate_is_measured_again(tmp_path: Path) -> None:
    path = tmp_path / "choices.json"
    path.write_text(json.dumps({"product": {"kernel": "amx_bf16", "times_ms": {"amx_bf16": 0.1}}}))
    fast = _work()
    choice = KernelChoices(path).choose("product", {"fast": fast, "slowed": _slowed(fast)})
    assert (choice.kernel, choice.source) == ("fast", "measured")
    assert json.loads(path.read_text())["product"]["kernel"] == "fast"


def test_an_unreadable_cache_file_is_measured_again_and_rewritten(tmp_path: Path) -> None:
    path = tmp_path / "choices.json"
    path.write_text("{not json")
    choice = KernelChoices(path).choose("product", {"only": _work(16)})
    assert choice.source == "measured"
    assert json.loads(path.read_text())["product"]["kernel"] == "only"


_RACE = """
import sys, torch
from pathlib import Path
from kvflow.kernels.choice import KernelChoices
a = torch.randn(64, 64)
same = lambda: a @ a
choice = KernelChoices(Path(sys.argv[1])).choose("tie", {"x": same, "y": same, "z": same}, rounds=20)
print(choice.kernel, choice.source)
"""


def test_processes_asking_at_once_get_one_choice(tmp_path: Path) -> None:
    """Three candidates doing the same work: noise decides which wins, so processes measuring on their own would
    disagree; under the file lock the first measures and the others read its choice."""
    path = tmp_path / "choices.json"
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _RACE, str(path)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    answers = [child.communicate(timeout=600)[0].split() for child in children]
    assert all(child.returncode == 0 for child in children)
    assert len({kernel for kernel, _ in answers}) == 1
    assert sorted(source for _, source in answers) == ["cached", "cached", "measured"]


def test_the_bf16_plan_never_picks_a_slowed_kernel_and_later_models_read_it(
    ops: ModuleType, clean_plan: None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each real candidate (torch and every kernel this CPU runs) competes beside a copy of itself slowed 3x: the
    plan takes a real one in every band, logs the choice once, and a second model in a later process (a new
    `KernelChoices` on the same file) reads it without timing anything."""
    if not runnable_gemm_kernels():
        pytest.skip(
            "kvflow's GEMM kernels need an AVX-512 build: torch runs every band, nothing to choose"
        )
    path = tmp_path / "choices.json"

    def slowed(kernel: str) -> Callable[[torch.Tensor, torch.Tensor], object]:
        def product(x: torch.Tensor, w: torch.Tensor) -> None:
            for _ in range(3):
                if kernel == TORCH:
                    F.linear(x, w)
                else:
                    ops.gemm_with(x, w, None, False, kernel)

        return product

    extra = {f"slowed_{name}": slowed(name) for name in (TORCH, *runnable_gemm_kernels())}
    with caplog.at_level(logging.INFO, logger="kvflow.kernels.bf16_gemm"):
        plan = kernels.choose_bf16_gemm_plan(
            SHAPES, choices=KernelChoices(path), extra_candidates=extra
        )
    assert [(first, last) for first, last, _ in plan.bands] == list(BF16_GEMM_BANDS)
    for (_, _, kernel), choice in zip(plan.bands, plan.choices, strict=True):
        assert not choice.kernel.startswith("slowed_"), plan.describe()
        assert kernel in (None, *runnable_gemm_kernels())
        assert choice.source == "measured"
        assert set(choice.times_ms) == {TORCH, *runnable_gemm_kernels(), *extra}
    assert kernels.bf16_gemm_plan() == plan
    logged = [r.getMessage() for r in caplog.records if "chosen by measurement" in r.getMessage()]
    assert len(logged) == 1 and "rows 9-16" in logged[0] and "384x256" in logged[0]

    kernels.forget_bf16_gemm_plan()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvflow.kernels.bf16_gemm"):
        again = kernels.choose_bf16_gemm_plan(
            SHAPES, choices=KernelChoices(path), extra_candidates=extra
        )
    assert again.bands == plan.bands
    assert all(choice.source == "cached" for choice in again.choices)


def test_kvflow_bf16_gemm_overrides_the_measurement(
    ops: ModuleType, clean_plan: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(kernels.BF16_GEMM_ENV, "torch")
    path = tmp_path / "choices.json"
    plan = kernels.choose_bf16_gemm_plan(SHAPES, choices=KernelChoices(path))
    assert plan == kernels.Bf16GemmPlan.uniform(None) and not plan.choices
    assert not path.exists()  # nothing measured
    assert kernels.linear(torch.randn(40, 256).bfloat16(), torch.randn(64, 256).bfloat16()) is None


def test_linear_follows_the_plan_band_by_band(ops: ModuleType, clean_plan: None) -> None:
    """A plan with a kernel for rows 9-16 and torch above: `linear` runs the kernel (bit for bit its `gemm_with`)
    for 12 rows and hands 24 to torch; the fused decode layer's row limit ends with the kernel's band."""
    if not runnable_gemm_kernels():
        pytest.skip("kvflow's GEMM kernels need an AVX-512 build")
    kernel = runnable_gemm_kernels()[-1]
    bands = tuple(
        (first, last, kernel if first == kernels.MAX_GEMV_ROWS + 1 else None)
        for first, last in BF16_GEMM_BANDS
    )
    kernels.use_bf16_gemm_plan(kernels.Bf16GemmPlan(bands))
    assert ops.gemm_kernel() == kernel
    weight = torch.randn(64, 256).bfloat16()
    twelve = torch.randn(12, 256).bfloat16()
    out = kernels.linear(twelve, weight)
    assert out is not None and torch.equal(out, ops.gemm_with(twelve, weight, None, False, kernel))
    assert kernels.linear(torch.randn(24, 256).bfloat16(), weight) is None
    assert kernels.bf16_kernel_max_rows() == 16 and kernels.gemm_kernel_wins_here()
    assert kernels.linear(torch.randn(4, 256).bfloat16(), weight) is not None  # the GEMV stays


def test_plan_row_limits() -> None:
    one = kernels.Bf16GemmPlan.uniform("avx512_bf16")
    assert (
        one.first_kernel_rows() == ("avx512_bf16", None) and one.kernel_for(10_000) == "avx512_bf16"
    )
    none = kernels.Bf16GemmPlan.uniform(None)
    assert none.first_kernel_rows() == (None, None) and none.kernel_for(9) is None
    mixed = kernels.Bf16GemmPlan(
        (
            (9, 16, "a"),
            (17, 32, "a"),
            (33, 64, None),
            (65, 128, "a"),
            (129, 256, None),
            (257, None, None),
        )
    )
    assert mixed.first_kernel_rows() == ("a", 32)
    assert [mixed.kernel_for(rows) for rows in (9, 32, 33, 100, 200, 5000)] == [
        "a", "a", None, "a", None, None,
    ]  # fmt: skip
