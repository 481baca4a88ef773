"""Quantized experts (`FusedMoE.quantize_experts`; `kvflow.kernels.quant.fused_moe`, csrc/quant_moe.cpp): the one
C++ call per layer against a dequantize-then-float-matmul reference per format, against the per-expert PyTorch loop
of the dense products (`FusedMoE.experts_quantized`), thread independence, and batch independence where
csrc/quant_moe.cpp states it (every expert of the token within the GEMV's rows).

The reference multiplies the dequantized weights in float32 against the activations as the products see them
(`quant.fake_quantize_activations`: int8 per block for Q4_0 / Q4_K / Q6_K and Q8_0, fp32 x for int8 up to the GEMV's
rows, and for Q8_0 under KVFLOW_Q8_0_ACTIVATIONS=float32). The intermediate activation (silu(gate) * up) is
quantized again before the down product, so a rounding difference in gate_up can move one of its quants by a step:
the bounds are relative norms, not elementwise.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from kvflow.distributed.parallel_state import TensorParallelGroup
from kvflow.kernels import quant
from kvflow.models.layers.fused_moe import FusedMoE, softmax_topk
from kvflow.models.quantization.ggml_quantize import quantize
from kvflow.models.quantization.gguf_file import GGUFTensor
from tests.kernels.conftest import kernels_disabled
from tests.kernels.quant_static import static_quant_plans  # noqa: F401

WEIGHT_TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q6_K", "int8")
# (num_experts, top_k, hidden, intermediate): rows of whole 256-element blocks for the K-quants.
SHAPE = (6, 2, 256, 512)
# Relative RMS error of the layer's output against the float reference on the same quantized weights: the
# activations' quantization (4-bit types: int8 per block) and the flips it allows; measured below 1e-3 / 4e-3.
# Q8_0 quantizes x per 32 (the default), as Q4_0 does: the same bound.
RELATIVE_RMS = {"Q8_0": 1e-2, "int8": 1e-5, "Q4_0": 1e-2, "Q4_K": 1e-2, "Q6_K": 1e-2}
BF16_RELATIVE_RMS = 1e-2


def quantized_layer(weight_type: str, dtype: torch.dtype, shape=SHAPE) -> FusedMoE:
    """A FusedMoE on `weight_type` experts loaded through its weight loaders (GGUF blocks from kvflow's quantizer,
    or float rows that the int8 loader quantizes)."""
    num_experts, top_k, hidden, intermediate = shape
    layer = FusedMoE(
        num_experts,
        top_k,
        hidden,
        intermediate,
        dtype=dtype,
        device=torch.device("cpu"),
        tp=TensorParallelGroup.single(),
    )
    layer.quantize_experts(weight_type, weight_type)
    generator = torch.Generator().manual_seed(hidden + intermediate)
    layer.gate.weight.data.copy_(torch.randn(num_experts, hidden, generator=generator) * 0.2)
    for expert in range(num_experts):
        for name, part, rows, columns in (
            ("w13_weight", 0, intermediate, hidden),
            ("w13_weight", 1, intermediate, hidden),
            ("w2_weight", 0, hidden, intermediate),
        ):
            weight = torch.randn(rows, columns, generator=generator) * 0.1
            if weight_type != "int8":
                blocks = torch.from_numpy(quantize(weight_type, weight.numpy()))
                weight = GGUFTensor(weight_type, blocks, (rows, columns))
            param = getattr(layer, name)
            param.weight_loader(param, weight, (expert, part))
    return layer


def dequantized(layer: FusedMoE) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's expert weights as float32 stacks."""

    def decode(weights: torch.Tensor, weight_type: str, scale: torch.Tensor | None) -> torch.Tensor:
        if weight_type == "int8":
            return weights.float() * scale[..., None]
        return torch.stack([quant.dequantize_reference(weight_type, w) for w in weights])

    int8 = layer.w13_type == "int8"
    return (
        decode(layer.w13_weight, layer.w13_type, layer.w13_scale if int8 else None),
        decode(layer.w2_weight, layer.w2_type, layer.w2_scale if int8 else None),
    )


def reference(
    layer: FusedMoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Float32 products on the dequantized weights, the activations fake-quantized as the decode products see
    them (`quant.fake_quantize_activations`), a token's results summed in ascending expert order."""
    w13, w2 = dequantized(layer)
    kind = layer.w13_type
    out = torch.zeros(x.shape[0], x.shape[1])
    for t in range(x.shape[0]):
        order = ids[t].argsort()
        for slot in order.tolist():
            expert = int(ids[t, slot])
            row = quant.fake_quantize_activations(kind, x[t : t + 1].float())
            gate, up = F.linear(row, w13[expert]).chunk(2, dim=-1)
            activated = quant.fake_quantize_activations(kind, F.silu(gate) * up)
            out[t] += float(weights[t, slot]) * F.linear(activated, w2[expert])[0]
    return out


def routed(layer: FusedMoE, num_tokens: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, layer.gate.weight.shape[1], generator=generator).to(dtype)
    weights, ids = softmax_topk(F.linear(x, layer.gate.weight), layer.top_k)
    return x, weights, ids


def relative_rms(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out.float() - expected).norm() / expected.norm())


@pytest.mark.parametrize("weight_type", WEIGHT_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_dequantized_reference(
    ops: ModuleType, weight_type: str, dtype: torch.dtype
) -> None:
    layer = quantized_layer(weight_type, dtype)
    # Decode-sized: every expert's group within the GEMV's rows, the activations as fake_quantize_activations says.
    x, weights, ids = routed(layer, 4, dtype, seed=1)
    out = quant.fused_moe(x, *layer._quantized_weights(), weights, ids)
    assert out is not None and out.dtype == dtype and out.shape == x.shape
    bound = RELATIVE_RMS[weight_type] + (BF16_RELATIVE_RMS if dtype is torch.bfloat16 else 0.0)
    assert relative_rms(out, reference(layer, x, weights, ids)) < bound
    assert torch.equal(layer.experts(x, weights, ids), out)  # the layer's path is this one call


@pytest.mark.parametrize("weight_type", WEIGHT_TYPES)
def test_kernel_matches_per_expert_products(ops: ModuleType, weight_type: str) -> None:
    """The one C++ call against the per-expert loop of quant.ggml_linear / int8_linear, for group sizes on every
    product (GEMV, interleaved tiles, tiled, W8A8): the same products, up to silu's last bit."""
    layer = quantized_layer(weight_type, torch.float32)
    for num_tokens in (1, 5, 40, 130):
        x, weights, ids = routed(layer, num_tokens, torch.float32, seed=num_tokens)
        out = quant.fused_moe(x, *layer._quantized_weights(), weights, ids)
        loop = layer.experts_quantized(x, weights, ids)
        assert relative_rms(out, loop) < 1e-3, num_tokens


@pytest.mark.parametrize("weight_type", WEIGHT_TYPES)
def test_token_alone_equals_token_in_a_batch(ops: ModuleType, weight_type: str) -> None:
    """Bitwise, with 1 and 2 threads, for batches where no expert gets more than the GEMV's 8 rows (8 tokens:
    a token picks an expert at most once)."""
    layer = quantized_layer(weight_type, torch.bfloat16)
    num_tokens = 24
    x, weights, ids = routed(layer, num_tokens, torch.bfloat16, seed=5)

    def run(rows: torch.Tensor) -> torch.Tensor:
        return quant.fused_moe(x[rows], *layer._quantized_weights(), weights[rows], ids[rows])

    threads = torch.get_num_threads()
    alone = torch.cat([run(torch.tensor([t])) for t in range(num_tokens)])
    permutation = torch.randperm(num_tokens, generator=torch.Generator().manual_seed(3))
    try:
        for num_threads in sorted({1, max(2, threads)}):
            torch.set_num_threads(num_threads)
            for batch_size in (2, 3, 8):
                for start in range(0, num_tokens, batch_size):
                    rows = permutation[start : start + batch_size]
                    assert torch.equal(run(rows), alone[rows]), (num_threads, batch_size)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("weight_type", ["Q4_K", "int8"])
def test_kernels_off_runs_the_reference_products(weight_type: str) -> None:
    layer = quantized_layer(weight_type, torch.float32)
    x, weights, ids = routed(layer, 3, torch.float32, seed=2)
    with kernels_disabled():
        assert quant.fused_moe(x, *layer._quantized_weights(), weights, ids) is None
        out = layer.experts(x, weights, ids)
    assert relative_rms(out, reference(layer, x, weights, ids)) < RELATIVE_RMS[weight_type]


def test_storage_and_refusals() -> None:
    layer = quantized_layer("Q4_K", torch.float32)
    num_experts, _, hidden, intermediate = SHAPE
    assert layer.w13_weight.dtype == torch.uint8
    assert layer.w13_weight.shape == (num_experts, 2 * intermediate, hidden // 256 * 144)
    assert layer.w2_weight.shape == (num_experts, hidden, intermediate // 256 * 144)
    assert layer.expert_weight_bytes() == num_experts * 3 * intermediate * hidden // 256 * 144
    param = layer.w2_weight
    with pytest.raises(ValueError, match="Q4_K blocks; got Q8_0"):
        blocks = torch.from_numpy(quantize("Q8_0", torch.zeros(hidden, intermediate).numpy()))
        param.weight_loader(param, GGUFTensor("Q8_0", blocks, (hidden, intermediate)), (0, 0))
    with pytest.raises(ValueError, match="weight updates"):
        param.weight_loader(param, torch.zeros(hidden, intermediate), (0, 0))
    odd = FusedMoE(
        2,
        1,
        256,
        160,
        dtype=torch.float32,
        device=torch.device("cpu"),
        tp=TensorParallelGroup.single(),
    )
    with pytest.raises(ValueError, match="whole blocks"):
        odd.quantize_experts("Q4_K", "Q4_K")
