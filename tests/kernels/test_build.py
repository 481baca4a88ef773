"""Building and caching the CPU kernels: a failed build falls back with one warning; the cache key tracks what
the binary depends on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvflow.kernels import build

_PROBE = """
import logging, torch
logging.basicConfig(level=logging.WARNING)
from kvflow.kernels import load_cpu_kernels, linear
from kvflow.models.attention import resolve_attention_backend
assert load_cpu_kernels() is None and load_cpu_kernels() is None
assert linear(torch.ones(1, 8).bfloat16(), torch.ones(4, 8).bfloat16()) is None
print(resolve_attention_backend("auto", torch.device("cpu")))
"""


def test_missing_compiler_warns_once_and_falls_back(tmp_path: Path) -> None:
    """As on a machine without a compiler: one warning, then every path is PyTorch's."""
    env = dict(
        os.environ,
        CXX=str(tmp_path / "no-such-compiler"),
        KVFLOW_KERNEL_CACHE_DIR=str(tmp_path / "kernels"),
        KVFLOW_CPU_KERNELS="1",
    )
    result = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "torch"
    assert result.stderr.count("kvflow CPU kernels unavailable") == 1, result.stderr
    assert not list((tmp_path / "kernels").glob("*/.complete"))


def test_extension_name_tracks_cpu_and_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    name = build.extension_name()
    assert name.startswith("kvflow_cpu_kernels_") and name == build.extension_name()
    monkeypatch.setattr(build, "_cpu_flags", lambda: "avx2 fma")
    assert build.extension_name() != name
    monkeypatch.setattr(build, "_CFLAGS", (*build._CFLAGS, "-DKVFLOW_TEST"))
    assert len({name, build.extension_name()}) == 2


def test_a_source_edit_gets_its_own_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every .cpp and .h is hashed into the name: changing a constant in kernels.h (say kMaxDecodeLayerRows,
    which the bindings export) builds anew instead of importing the stale binary."""
    import shutil

    sources = tmp_path / "csrc"
    shutil.copytree(build.SOURCE_DIR, sources)
    monkeypatch.setattr(build, "SOURCE_DIR", sources)
    name = build.extension_name()
    header = sources / "kernels.h"
    header.write_text(
        header.read_text().replace("kMaxDecodeLayerRows = ", "kMaxDecodeLayerRows = 1 + ")
    )
    assert build.extension_name() != name


def test_setting_values(monkeypatch: pytest.MonkeyPatch) -> None:
    for value in ("0", "false", "OFF", "no"):
        monkeypatch.setenv(build.CPU_KERNELS_ENV, value)
        assert not build.cpu_kernels_requested()
    for value in ("1", "true", ""):
        monkeypatch.setenv(build.CPU_KERNELS_ENV, value)
        assert build.cpu_kernels_requested()
