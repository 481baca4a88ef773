"""Session-wide test setup: the built-in default model is built into a temporary cache, never ~/.cache."""

from __future__ import annotations

import os
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
