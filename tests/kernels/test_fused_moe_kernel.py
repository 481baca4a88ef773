"""The mixture-of-experts kernel (`kvflow.kernels.fused_moe`, csrc/fused_moe.cpp) against `FusedMoE`'s PyTorch
experts path, and its batch independence.

Batch independence is bitwise: a token's output row is the same run alone, in batches of several sizes (so its
experts' groups hold from one row to over a hundred: every tile height of the products, one and several tiles) and
with one or two threads, for both product kernels (the GEMM kernel the layer uses and the GEMV one) and both dtypes.
Against PyTorch the products sum in another order: float32 agrees to float32 rounding, bfloat16 to a few bfloat16
ulps of the output's scale (a different rounding of an intermediate moves a result by one ulp of that value).
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from kvflow import kernels
from kvflow.distributed.parallel_state import TensorParallelGroup
from kvflow.models.layers.fused_moe import FusedMoE, softmax_topk
from tests.kernels.conftest import kernels_disabled

# (num_experts, top_k, hidden, intermediate): hidden and intermediate off the 16- and 32-lane widths too; top-1
# routing gives single tokens one expert, whose products (over 64 rows: several blocks) the threads then split
# (more experts: one per thread).
SHAPES = [(8, 2, 80, 40), (16, 4, 256, 96), (4, 2, 48, 24), (4, 1, 160, 72)]


def make_layer(
    num_experts: int, top_k: int, hidden: int, intermediate: int, dtype: torch.dtype
) -> FusedMoE:
    layer = FusedMoE(
        num_experts,
        top_k,
        hidden,
        intermediate,
        dtype=dtype,
        device=torch.device("cpu"),
        tp=TensorParallelGroup.single(),
    )
    generator = torch.Generator().manual_seed(num_experts * hidden + intermediate)
    for param in (layer.gate.weight, layer.w13_weight, layer.w2_weight):
        param.data.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return layer


def routed_tokens(
    layer: FusedMoE, num_tokens: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random hidden states and their (float32 weights, int64 ids) from the layer's router."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, layer.gate.weight.shape[1], generator=generator).to(dtype)
    weights, ids = softmax_topk(torch.nn.functional.linear(x, layer.gate.weight), layer.top_k)
    return x, weights, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("gemm", [True, False])
def test_token_alone_equals_token_in_any_batch(
    ops: ModuleType, dtype: torch.dtype, shape: tuple[int, int, int, int], gemm: bool
) -> None:
    layer = make_layer(*shape, dtype)
    num_tokens = 150
    x, weights, ids = routed_tokens(layer, num_tokens, dtype, seed=7)

    def run(rows: torch.Tensor) -> torch.Tensor:
        return ops.fused_moe(
            x[rows].contiguous(), layer.w13_weight, layer.w2_weight, weights[rows], ids[rows], gemm
        )

    threads = torch.get_num_threads()
    alone = torch.cat([run(torch.tensor([t])) for t in range(num_tokens)])
    permutation = torch.randperm(num_tokens, generator=torch.Generator().manual_seed(3))
    try:
        for num_threads in sorted({1, max(2, threads)}):
            torch.set_num_threads(num_threads)
            for batch_size in (2, 5, 16, 37, num_tokens):
                for start in range(0, num_tokens, batch_size):
                    rows = permutation[start : start + batch_size]
                    assert torch.equal(run(rows), alone[rows]), (num_threads, batch_size, start)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("num_tokens", [1, 3, 64])
def test_kernel_matches_pytorch_experts(
    ops: ModuleType, dtype: torch.dtype, shape: tuple[int, int, int, int], num_tokens: int
) -> None:
    layer = make_layer(*shape, dtype)
    x, weights, ids = routed_tokens(layer, num_tokens, dtype, seed=num_tokens)
    expected = layer.experts_torch(x, weights, ids)
    for gemm in (True, False):
        out = ops.fused_moe(x, layer.w13_weight, layer.w2_weight, weights, ids, gemm)
        assert out.dtype == dtype and out.shape == expected.shape
        if dtype is torch.float32:
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        else:
            scale = float(expected.float().abs().max())
            torch.testing.assert_close(
                out.float(), expected.float(), rtol=2**-6, atol=2**-6 * scale
            )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_runs_the_kernel_and_falls_back_to_pytorch(
    ops: ModuleType, dtype: torch.dtype
) -> None:
    layer = make_layer(8, 2, 80, 40, dtype)
    x, weights, ids = routed_tokens(layer, 12, dtype, seed=5)
    kernel_out = kernels.fused_moe(x, layer.w13_weight, layer.w2_weight, weights, ids)
    assert kernel_out is not None
    assert torch.equal(layer(x), kernel_out)
    with kernels_disabled():
        assert kernels.fused_moe(x, layer.w13_weight, layer.w2_weight, weights, ids) is None
        fallback = layer(x)
    assert torch.equal(fallback, layer.experts_torch(x, weights, ids))


def test_expert_id_out_of_range_is_refused(ops: ModuleType) -> None:
    layer = make_layer(4, 2, 48, 24, torch.float32)
    x, weights, ids = routed_tokens(layer, 3, torch.float32, seed=1)
    ids[1, 0] = 4
    with pytest.raises(RuntimeError, match="topk_ids must lie in"):
        ops.fused_moe(x, layer.w13_weight, layer.w2_weight, weights, ids, True)
