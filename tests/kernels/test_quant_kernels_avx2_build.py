"""The quantized-weight kernels' AVX2 code paths, run on an AVX-512 machine.

csrc/quant_*.cpp have an AVX-512 form of the Q8_0 and int8 GEMVs and an AVX2 form of every kernel; `-march=native`
builds only the one this CPU takes, so on an AVX-512 machine the suite never runs the AVX2 ones (the CI machine may
be either). This test builds the extension once more with `-mno-avx512f`, into its own cache folder, and runs the
kernel tests and the GGUF / int8 model tests in a subprocess against that build. Slow: one more compile (~30 s)
and those tests again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvflow.kernels import load_cpu_kernels
from kvflow.kernels.build import KERNEL_CACHE_DIR_ENV, cpu_feature_flags

TESTS = Path(__file__).resolve().parents[1]

# Patches the build flags before anything loads the extension, checks the build is the AVX2 one, then runs pytest.
_RUNNER = """
import sys
import kvflow.kernels.build as build
build._CFLAGS = build._CFLAGS + ("-mno-avx512f",)
ops = build.load_cpu_kernels()
assert ops is not None and ops.has_avx2() and not ops.has_avx512(), "not an AVX2-only build"
import pytest
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
"""


@pytest.mark.slow
def test_the_avx2_kernels_pass_the_quantization_tests(tmp_path: Path) -> None:
    if "avx512f" not in cpu_feature_flags():
        pytest.skip("this CPU has no AVX-512: the suite's own build already runs the AVX2 paths")
    if load_cpu_kernels() is None:
        pytest.skip("the CPU kernels are off or cannot be built here")
    env = {**os.environ, KERNEL_CACHE_DIR_ENV: str(tmp_path / "kernels")}
    completed = subprocess.run(
        [
            sys.executable,
            "-c",
            _RUNNER,
            str(TESTS / "kernels" / "test_quant_kernels.py"),
            str(TESTS / "models" / "test_gguf_models.py"),
            str(TESTS / "models" / "test_int8_quantization.py"),
            "-m",
            "not slow",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-4000:]
    assert " passed" in output and "failed" not in output, output[-2000:]
