"""Session-wide test setup: the built-in default model is built into a temporary cache, never ~/.cache."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest


def _share_kernel_builds() -> None:
    """Keep the compiled CPU kernels in the machine's real cache (keyed by source hash, so sharing is safe) and
    build them now, once: test subprocesses (servers, CLI runs) then import the finished build instead of
    compiling inside a health-check timeout."""
    from kvflow.kernels.build import KERNEL_CACHE_DIR_ENV, kernels_build_dir, load_cpu_kernels

    os.environ.setdefault(KERNEL_CACHE_DIR_ENV, str(kernels_build_dir()))
    load_cpu_kernels()


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C tests need Python's SIGINT handler. A suite started in the background by a non-interactive shell
    (`cmd &`) inherits SIGINT ignored, which Python then leaves in place and every child process inherits; put the
    default back so those tests behave the same however the suite was started."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _one_thread_per_parallel_worker()


def _one_thread_per_parallel_worker() -> None:
    """Under pytest-xdist the workers already fill the cores: each worker, and every engine, server and rank process
    it starts (they inherit the variable), runs torch on one thread. Several processes each spinning OpenMP threads
    over the same two cores (more so beside other work) wait on one another's descheduled threads at every
    parallel region: the suite ran several times slower than on one thread each. Tests about thread counts set them
    explicitly (`torch.set_num_threads`); an OMP_NUM_THREADS given by the caller is left alone."""
    if "PYTEST_XDIST_WORKER" not in os.environ or "OMP_NUM_THREADS" in os.environ:
        return
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def kvflow_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point KVFLOW_CACHE_DIR (read by the default model and inherited by CLI subprocesses) at a session tmp dir."""
    cache_dir = tmp_path_factory.mktemp("kvflow-cache")
    previous = os.environ.get("KVFLOW_CACHE_DIR")
    _share_kernel_builds()
    os.environ["KVFLOW_CACHE_DIR"] = str(cache_dir)
    yield cache_dir
    if previous is None:
        os.environ.pop("KVFLOW_CACHE_DIR", None)
    else:
        os.environ["KVFLOW_CACHE_DIR"] = previous
