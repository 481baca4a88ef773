"""A module-scoped autouse fixture that pins the quantized products to their static thresholds
(`KVFLOW_QUANT_GEMM=static`), for test modules that check specific paths (the GEMV, the tiled kernel, W8A8, the
dequantized GEMM at given row counts) rather than whatever this machine measured. Module-scoped so that it is set
before any module-scoped model fixture builds a model (a model measures its plans at construction), and inherited
by the engine processes those tests start. Import it into a test module: `from tests.kernels.quant_static import
static_quant_plans  # noqa: F401`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvflow.kernels.quant_plan import QUANT_GEMM_ENV, forget_quant_gemm_plans


@pytest.fixture(scope="module", autouse=True)
def static_quant_plans() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv(QUANT_GEMM_ENV, "static")
        forget_quant_gemm_plans()
        yield
    forget_quant_gemm_plans()
