"""The C++ bf16 GEMM (M > 8 rows), each of its kernels, against float32 `F.linear` of the same bfloat16 inputs, and
the choice of kernel (`KVFLOW_BF16_GEMM`, the CPU's default) that `kernels.linear` sends those rows to.

Kernels: `widened_fp32` (any AVX-512 CPU); `avx512_bf16` (vdpbf16ps), run wherever the CPU executes the
instruction, which a child process finds out (a hypervisor may hide the CPUID flag of a CPU that has it, as on this
project's Xeon machines); `amx_bf16_emulated`, the AMX kernel on the scalar tile emulation (every CPU); `amx_bf16`,
the same on the hardware where this CPU and process can use AMX tiles (skipped elsewhere, saying so).

Tolerance: the kernel rounds a float32 sum once to bfloat16, so with `ref` the float32 reference and
`sum_abs = |x| @ |w|.T (+ |bias|)`: `|out - ref| <= 2^-8 |ref| + 2 K 2^-24 sum_abs` (half a bfloat16 ulp of the
rounding, plus float32 rounding of two sums taken in different orders). `float_output` must be that bfloat16
result, upcast, bit for bit.

Shapes cover the kernel's edges: K not a multiple of 16 and wider than one K block (1024), N not a multiple of the
4-row group or the 64-row block, every last-tile height 1..6 of the 6-row x tiles, M above the 512-row pass,
strided x rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from kvflow import kernels
from kvflow.kernels import (
    BF16_GEMM_ENV,
    bf16_gemm_kernel,
    cpu_executes_avx512_bf16,
    cpu_feature_flags,
    gemm_kernel_wins,
)
from kvflow.models.hf_config import load_hf_config
from kvflow.models.layers import Linear
from kvflow.models.llama import LlamaForCausalLM
from kvflow.testing.hf_checkpoints import make_tiny_checkpoint

KERNELS = ("widened_fp32", "avx512_bf16", "amx_bf16_emulated", "amx_bf16")

ICE_LAKE_SERVER = frozenset(
    {"fpu", "sse2", "avx", "avx2", "fma", "avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl"}
    | {"avx512_vnni", "avx512vbmi"}
)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


def _assert_close_to_reference(
    out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    float_bias = None if bias is None else bias.float()
    reference = F.linear(x.float(), weight.float(), float_bias)
    sum_abs = F.linear(
        x.float().abs(), weight.float().abs(), None if bias is None else float_bias.abs()
    )
    bound = reference.abs() * 2.0**-8 + 2 * x.shape[-1] * 2.0**-24 * sum_abs
    excess = (out.float() - reference).abs() - bound
    assert float(excess.max()) <= 0.0, float(excess.max())


@pytest.fixture(params=KERNELS)
def kernel(request: pytest.FixtureRequest, ops: ModuleType) -> str:
    name = str(request.param)
    if not ops.has_avx512():
        pytest.skip("the GEMM kernels need an AVX-512 build")
    if name == "avx512_bf16" and not cpu_executes_avx512_bf16():
        pytest.skip("this CPU does not execute vdpbf16ps")
    if name == "amx_bf16" and not ops.amx_usable():
        pytest.skip(
            "no AMX here (not in CPUID, or the kernel refused the tile state): emulated only"
        )
    return name


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize(
    ("num_rows", "output_size", "input_size"),
    [(9, 7, 13), (17, 65, 300), (34, 130, 1030), (13, 200, 2100), (515, 70, 40)],
)
def test_gemm_matches_float32_linear(
    ops: ModuleType,
    threads: int,
    kernel: str,
    num_rows: int,
    output_size: int,
    input_size: int,
    with_bias: bool,
) -> None:
    generator = torch.Generator().manual_seed(num_rows * output_size + input_size)
    weight = torch.randn(output_size, input_size, generator=generator).bfloat16()
    bias = torch.randn(output_size, generator=generator).bfloat16() if with_bias else None
    wide = torch.randn(num_rows, input_size + 5, generator=generator).bfloat16()
    x = wide[:, 3 : 3 + input_size]  # rows input_size + 5 apart
    out = ops.gemm_with(x, weight, bias, False, kernel)
    assert out.dtype == torch.bfloat16 and out.shape == (num_rows, output_size)
    _assert_close_to_reference(out, x, weight, bias)
    as_float = ops.gemm_with(x, weight, bias, True, kernel)
    assert as_float.dtype == torch.float32 and torch.equal(as_float, out.float())
    assert torch.equal(ops.gemm_with(x.contiguous(), weight, bias, False, kernel), out)
    if kernel == ops.gemm_kernel():
        assert torch.equal(ops.gemm(x, weight, bias, False), out)


def test_each_output_is_summed_alone(ops: ModuleType, kernel: str) -> None:
    """A row's outputs do not depend on the rows beside it or on the thread count (fixed summation order)."""
    generator = torch.Generator().manual_seed(11)
    weight = torch.randn(70, 530, generator=generator).bfloat16()
    x = torch.randn(40, 530, generator=generator).bfloat16()
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat(
            [ops.gemm_with(x[i : i + 9], weight, None, False, kernel) for i in (0, 9, 18, 27)]
        )
        torch.set_num_threads(2)
        together = ops.gemm_with(x[:36], weight, None, False, kernel)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(alone, together)


def test_gemm_checks_its_arguments(ops: ModuleType) -> None:
    weight = torch.randn(8, 16).bfloat16()
    with pytest.raises(RuntimeError, match="x must be a bfloat16"):
        ops.gemm(torch.randn(9, 16), weight, None, False)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="weight must be contiguous"):
        ops.gemm(torch.randn(9, 16).bfloat16(), weight.t().contiguous().t(), None, False)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="bias must be contiguous"):
        ops.gemm(torch.randn(9, 16).bfloat16(), weight, torch.zeros(7).bfloat16(), False)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="kernel must be one of widened_fp32, avx512_bf16"):
        ops.gemm_with(torch.randn(9, 16).bfloat16(), weight, None, False, "fastest")
    if not ops.amx_usable():
        with pytest.raises(RuntimeError, match="kernel amx_bf16: this CPU"):
            ops.gemm_with(torch.randn(9, 16).bfloat16(), weight, None, False, "amx_bf16")


@pytest.mark.parametrize(
    ("flags", "wins"),
    [
        (ICE_LAKE_SERVER, True),  # this project's CI CPU: AVX-512 without native bf16 matmul
        (
            ICE_LAKE_SERVER | {"avx512_bf16"},
            True,
        ),  # Zen 4, Cooper Lake: a kernel still wins (see the default)
        (ICE_LAKE_SERVER | {"avx512_bf16", "amx_bf16", "amx_tile"}, True),  # Sapphire Rapids
        (ICE_LAKE_SERVER - {"avx512bw"}, False),  # the kernels need AVX512BW/VL
        (frozenset(["fpu", "sse2", "avx", "avx2", "fma"]), False),  # AVX2 only
        (frozenset(), False),  # flags unknown (not Linux)
    ],
)
def test_gemm_kernel_wins_on_avx512_cpus(flags: frozenset[str], wins: bool) -> None:
    assert gemm_kernel_wins(flags) is wins


def _cpu_vendor() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("vendor_id"):
            return line.split(":", 1)[1].strip()
    return ""


def test_the_default_kernel_is_amx_then_amd_bf16_then_widened(ops: ModuleType) -> None:
    if not ops.has_avx512():
        pytest.skip("the GEMM kernels need an AVX-512 build")
    flags = cpu_feature_flags()
    if ops.amx_usable():
        assert {"amx_tile", "amx_bf16", "amx_int8"} <= flags
        expected = "amx_bf16"
    elif ops.cpu_has_avx512_bf16() and _cpu_vendor() == "AuthenticAMD":
        expected = "avx512_bf16"
    else:
        expected = "widened_fp32"
    assert ops.cpu_has_avx512_bf16() is ("avx512_bf16" in flags)
    assert ops.default_gemm_kernel() == expected


@pytest.fixture
def gemm_choice(ops: ModuleType, monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """A clean `bf16_gemm_kernel` (and no measured plan) for one test of `KVFLOW_BF16_GEMM`; the default restored
    afterwards."""
    kernels.forget_bf16_gemm_plan()
    yield monkeypatch
    monkeypatch.delenv(BF16_GEMM_ENV, raising=False)
    kernels.forget_bf16_gemm_plan()
    ops.set_gemm_kernel(ops.default_gemm_kernel())


def test_an_unknown_bf16_gemm_choice_fails_when_the_model_is_built(
    gemm_choice: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    gemm_choice.setenv(BF16_GEMM_ENV, "fastest")
    config = load_hf_config(make_tiny_checkpoint(tmp_path, "llama", seed=1, dtype="bfloat16"))
    with pytest.raises(ValueError, match="KVFLOW_BF16_GEMM='fastest' is not one of auto, torch"):
        LlamaForCausalLM(config, dtype=torch.bfloat16)


def test_torch_choice_keeps_f_linear_above_the_gemv(
    ops: ModuleType, gemm_choice: pytest.MonkeyPatch
) -> None:
    gemm_choice.setenv(BF16_GEMM_ENV, "torch")
    assert bf16_gemm_kernel() is None and not kernels.gemm_kernel_wins_here()
    weight = torch.randn(32, 64).bfloat16()
    assert kernels.linear(torch.randn(24, 64).bfloat16(), weight) is None
    assert kernels.linear(torch.randn(4, 64).bfloat16(), weight) is not None  # the GEMV stays


@pytest.mark.parametrize("choice", ["widened_fp32", "avx512_bf16", "amx_bf16"])
def test_a_named_kernel_serves_linear_where_the_cpu_runs_it(
    ops: ModuleType, gemm_choice: pytest.MonkeyPatch, choice: str
) -> None:
    if not ops.has_avx512():
        pytest.skip("the GEMM kernels need an AVX-512 build")
    gemm_choice.setenv(BF16_GEMM_ENV, choice)
    runs_here = {
        "widened_fp32": True,
        "avx512_bf16": ops.cpu_has_avx512_bf16(),
        "amx_bf16": ops.amx_usable(),
    }[choice]
    if (
        not runs_here
    ):  # CPUID (and the AMX permission) decide; a kernel the CPU lacks is refused by name
        with pytest.raises(ValueError, match=f"KVFLOW_BF16_GEMM={choice}: this CPU cannot run it"):
            bf16_gemm_kernel()
        return
    assert bf16_gemm_kernel() == choice and ops.gemm_kernel() == choice
    weight = torch.randn(48, 64).bfloat16()
    hidden = torch.randn(24, 64).bfloat16()
    out = kernels.linear(hidden, weight)
    assert out is not None and torch.equal(out, ops.gemm_with(hidden, weight, None, False, choice))


def test_linear_dispatches_rows_above_the_gemv_to_the_gemm_where_it_wins(ops: object) -> None:
    layer = Linear(64, (48, 16), bias=True, dtype=torch.bfloat16, device="cpu")
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    hidden = torch.randn(3, kernels.MAX_GEMV_ROWS, 64).bfloat16()  # 24 rows, leading dims kept
    out = kernels.linear(hidden, layer.weight, layer.bias)
    if gemm_kernel_wins(cpu_feature_flags()) and ops.has_avx512():  # type: ignore[attr-defined]
        expected = ops.gemm(hidden.reshape(-1, 64), layer.weight, layer.bias, False)  # type: ignore[attr-defined]
        assert out is not None and torch.equal(out, expected.view(3, kernels.MAX_GEMV_ROWS, 64))
        as_float = kernels.linear(hidden, layer.weight, layer.bias, float_output=True)
        assert as_float is not None and torch.equal(as_float, out.float())
        assert torch.equal(layer(hidden), out)
    else:
        assert out is None
        assert torch.equal(layer(hidden), F.linear(hidden, layer.weight, layer.bias))
    assert kernels.linear(hidden.float(), layer.weight.float()) is None  # float32: torch's own GEMM


def test_setting_off_keeps_f_linear_for_many_rows(ops: object, kernels_off: None) -> None:
    weight = torch.randn(32, 64).bfloat16()
    assert kernels.linear(torch.randn(64, 64).bfloat16(), weight) is None
