"""Shared set-up for the CPU kernel tests: the compiled module (built once per machine, see kvflow/kernels/build.py)
and a way to force the pure-PyTorch paths inside one test."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from types import ModuleType

import pytest

from kvflow.kernels import CPU_KERNELS_ENV, forget_bf16_gemm_plan, load_cpu_kernels


@pytest.fixture(scope="session")
def ops() -> ModuleType:
    """The kernel module; a machine with a C++ compiler must build it (a broken build fails here, not silently)."""
    module = load_cpu_kernels()
    if module is None:
        if os.environ.get(CPU_KERNELS_ENV, "1") == "0" or not shutil.which("c++"):
            pytest.skip("CPU kernels disabled or no C++ compiler on this machine")
        pytest.fail(
            "a C++ compiler is present but the CPU kernels did not build (see the warning log)"
        )
    return module


@contextlib.contextmanager
def kernels_disabled() -> Iterator[None]:
    """`KVFLOW_CPU_KERNELS=0` inside the block. Every per-process cache derived from the kernel module (the module
    itself and the bfloat16 GEMM choice) is cleared on entry and on exit: a choice cached while the kernels were off
    (None) would otherwise outlive the block and quietly send later tests in the same process to torch's path."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv(CPU_KERNELS_ENV, "0")
        load_cpu_kernels.cache_clear()
        forget_bf16_gemm_plan()
        try:
            yield
        finally:
            monkeypatch.delenv(CPU_KERNELS_ENV)
            load_cpu_kernels.cache_clear()
            forget_bf16_gemm_plan()


@pytest.fixture
def kernels_off() -> Iterator[None]:
    """`KVFLOW_CPU_KERNELS=0` for one test (`kernels_disabled`)."""
    with kernels_disabled():
        yield
