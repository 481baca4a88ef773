"""Quantized weights on the CPU: llama.cpp's GGUF block formats (Q8_0, Q4_0, Q4_K, Q6_K) and weight-only int8.

GGUF weights stay in their blocks: a tensor `[N, K]` is a uint8 tensor `[N, ggml_row_bytes(qtype, K)]`, each row
the bytes of a GGUF tensor's row (whole blocks). `dequantize_reference` is the pure-PyTorch decoding, equal to
`gguf.quants.dequantize` bit for bit: the kernels and the model tests are checked against it, and it is the path
when the C++ kernels are off (`KVFLOW_CPU_KERNELS=0`, no compiler, no AVX2).

Products (`ggml_linear`, `int8_linear`) run in the C++ extension (csrc/quant_*.cpp) when it is loaded on an AVX2 or
AVX-512 build, chosen by the number of activation rows M as the weight type's plan says (`quant_plan`: the static
thresholds below, or under `KVFLOW_QUANT_GEMM=auto`, the default, the products a model measured fastest for each
band of rows on its own layer shapes, `quant_choice`); `run_product` runs one product, and `kernel_rows` the rows one
extension call covers, which the fused decode layer (through `LinearMethod.fused_decode_product`) reads. The static
plan:

* Q4_0, Q4_K, Q6_K (int8 activations), every M: the integer block product. Up to 8 rows it is a GEMV on the
  blocks themselves, each weight byte read once per call, nothing dequantized to memory; above, the same kernel
  blocked (16-row weight tiles in cache against 64-row blocks of x, 8 rows per register pass), the weights read
  once per 64 rows. On AVX-512 VNNI CPUs, above `k_quant_interleaved_above_rows()` (8) rows, they run on
  interleaved tiles instead: each thread repacks 16 weight rows at a time (in cache, per call; the weights in
  memory stay GGUF blocks) so that vector lanes are weight rows, one vpdpbusd adds 64 products against 4 of x's
  quants broadcast, and the scales apply once per 32 (Q4_0, Q4_K) or 16 (Q6_K) columns: the same int8
  activations and integer dots. Q4_0 keeps llama.cpp's per-32 x quants at every M.
* Q8_0 and int8 (Q8_0: x quantized per 32 elements as Q4_0's is, or float32 x under
  `KVFLOW_Q8_0_ACTIVATIONS=float32`; int8: float32 x; above the W8A8 thresholds below only on CPUs without VNNI),
  by M: up to `QUANT_GEMV_MAX_ROWS` (decode, speculative verification) the GEMV (Q8_0 on quantized x: integer dots,
  vpdpbusd on VNNI CPUs, one float multiply-add per block; blocked above 8 rows, no interleaved tiles); up to
  `QUANT_TILED_MAX_ROWS` (int8:
  `INT8_TILED_MAX_ROWS`) a tiled kernel that dequantizes a few weight rows at a time into a thread-local fp32 tile
  (in cache) and multiplies every activation row against it (the weights still stream once per call); larger M
  (prefill): the whole weight dequantized in C++, then torch's fp32 GEMM.
* int8 on an AVX-512 VNNI CPU (`quantizes_activation_rows`), above `QUANT_GEMV_MAX_ROWS`, and Q8_0 there above
  `QUANT_TILED_MAX_ROWS` (prefill; `ggml_linear_w8a8`: exact int32 dots per block, times d_b): W8A8, as llama.cpp
  multiplies Q8_0 at every M: each x row quantized alone (d = amax / 127, the `fake_quantize_int8_rows` view),
  exact int32 dots (vpdpbusd, 4 weight rows x 5 x rows per register block, the weights read once per ~512 KiB of x
  quants), times d_x * scale[n]. A row's output does not depend on the rows beside it.

Activations: Q4_0, Q4_K and Q6_K products quantize x to int8 first, as llama.cpp does (its `vec_dot_type`: Q8_0
blocks for Q4_0 and Q8_0, Q8_K super-blocks for the K-quants), per block of the weight type: one float32 scale d =
amax / 127 per 32 (Q4_0, and Q8_0 by default) or 256 (Q4_K, Q6_K) elements, q = round(x / d)
(`quantize_activations_reference`). The GEMV then multiplies integers (u8 x s8 pairs into int16, then int32 with the
sub-block scales as int16 multipliers) and converts to float once per block or super-block. The integer kernels sum
each activation row alone, so a request's numbers do not depend on how many rows share its step (bit for bit) on
either side of the interleaved tiles' threshold (the GEMV and the tiles add the same integers in different float
orders); the C++ tiled kernel (reachable directly) and the reference (`KVFLOW_CPU_KERNELS=0`) multiply the
fake-quantized x (`fake_quantize_activations`), the same sum up to fp32 summation order. Q8_0 does the same up to
`QUANT_TILED_MAX_ROWS` rows (its integer dot: 1.05-1.9x the float32-x GEMV's speed on Zen 4, benchmarks/RESULTS.md
"Q8_0 decode on quantized activations"); `KVFLOW_Q8_0_ACTIVATIONS=float32` keeps float32 x there instead (the
kernels read the variable at each call; a value other than "int8" or "float32" is a ValueError naming it), so that a
Q8_0 model decodes exactly like its float32 dequantization. int8 keeps fp32 x up to `QUANT_GEMV_MAX_ROWS` (decode),
and at every M on CPUs without VNNI.

Mixture-of-experts layers with quantized experts (`fused_moe`, csrc/quant_moe.cpp) run every selected expert's
gate_up and down products over the tokens that picked it on these same products, chosen by the group's row count
with the static thresholds above (not a measured plan), the loop over experts in C++ (one call per layer).

Every C++ path computes each output element on one thread in a fixed order: results do not depend on the thread
count. The dequantize + torch fp32 GEMM paths (statically Q8_0 and int8 at prefill-sized M on CPUs without the W8A8
kernels; any type in a band where a measured plan chose it) sum as torch's BLAS does, which on some CPUs splits a sum
by thread count. A measured plan may also put a band of the 4-bit types on another product than the integer one
(the same fake-quantized x, another fp32 summation order): their rows are then bitwise batch-independent within a
band, not across bands. The cached choice makes every process on a machine follow the same plan.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvflow.kernels.build import load_cpu_kernels
from kvflow.kernels.quant_plan import (
    DEQUANT,
    GEMV,
    INT8_TILED_MAX_ROWS,
    INTEGER_PRODUCT_TYPES,
    Q8_0_ACTIVATIONS_ENV,
    QUANT_GEMV_MAX_ROWS,
    QUANT_TILED_MAX_ROWS,
    W8A8,
    KernelRows,
    q8_0_activations,
    quant_gemm_plan,
)

__all__ = [
    "ACTIVATION_BLOCK_SIZES",
    "GGML_BLOCK_SIZES",
    "INT8_TILED_MAX_ROWS",
    "INT8_TYPE_CODE",
    "INTEGER_PRODUCT_TYPES",
    "Q8_0_ACTIVATIONS_ENV",
    "Q8_0_ACTIVATION_BLOCK",
    "QUANT_GEMV_MAX_ROWS",
    "QUANT_TILED_MAX_ROWS",
    "KernelRows",
    "activation_block_size",
    "dequantize",
    "dequantize_reference",
    "fake_quantize_activations",
    "fake_quantize_int8_rows",
    "fused_moe",
    "ggml_linear",
    "ggml_linear_for",
    "ggml_row_bytes",
    "ggml_type_code",
    "int8_linear",
    "int8_linear_for",
    "int8_quantize",
    "kernel_rows",
    "kernel_type_code",
    "kernels_in_use",
    "q8_0_activations",
    "quantize_activations_reference",
    "quantizes_activation_rows",
    "run_product",
]

# (elements per block, bytes per block), by gguf's GGMLQuantizationType name.
GGML_BLOCK_SIZES: dict[str, tuple[int, int]] = {
    "Q8_0": (32, 34),
    "Q4_0": (32, 18),
    "Q4_K": (256, 144),
    "Q6_K": (256, 210),
}
# Elements per activation scale for the weight types whose products always quantize x to int8; Q8_0's quantize it
# per 32 too unless `KVFLOW_Q8_0_ACTIVATIONS=float32` (`activation_block_size`).
ACTIVATION_BLOCK_SIZES: dict[str, int] = {"Q4_0": 32, "Q4_K": 256, "Q6_K": 256}
Q8_0_ACTIVATION_BLOCK = 32
# The extension's type codes (csrc/kernels.h, `GgmlType`).
_GGML_TYPE_CODES = {"Q8_0": 0, "Q4_0": 1, "Q4_K": 2, "Q6_K": 3}
# The extension's type code of int8 rows with a float32 scale per row (csrc/kernels.h, `kInt8Weights`).
INT8_TYPE_CODE = -1

LinearFn = Callable[..., torch.Tensor]


def ggml_type_code(qtype: str) -> int:
    """The C++ extension's code for a GGUF block type (csrc/kernels.h `GgmlType`)."""
    return _GGML_TYPE_CODES[qtype]


def kernel_type_code(weight_type: str) -> int:
    """The extension's code for a weight type's runs: `ggml_type_code` for GGUF types, `INT8_TYPE_CODE` for "int8"."""
    return INT8_TYPE_CODE if weight_type == "int8" else _GGML_TYPE_CODES[weight_type]


def kernel_rows(weight_type: str) -> KernelRows:
    """`KernelRows` of a weight type ("int8" or a GGUF block type) under this process's plan
    (`quant_plan.quant_gemm_plan`): the rows one extension call covers, as the fused decode layer runs them;
    ValueError for another type."""
    return quant_gemm_plan(weight_type).kernel_rows()


def kernels_in_use() -> bool:
    """Whether quantized products run on the C++ kernels in this process (the extension loaded, built for AVX2 or
    AVX-512): what `ggml_linear_for` and `int8_linear_for` decide when called now."""
    return _kernel_ops() is not None


def ggml_row_bytes(qtype: str, num_columns: int) -> int:
    """Bytes of one row of `num_columns` elements in `qtype`; ValueError for an unknown type or a partial block."""
    if qtype not in GGML_BLOCK_SIZES:
        raise ValueError(
            f"unknown GGML quantization type {qtype!r} (known: {sorted(GGML_BLOCK_SIZES)})"
        )
    block_elements, block_bytes = GGML_BLOCK_SIZES[qtype]
    if num_columns % block_elements:
        raise ValueError(
            f"{qtype} rows hold whole blocks of {block_elements} elements; {num_columns} columns is not a multiple"
        )
    return num_columns // block_elements * block_bytes


def _num_columns(qtype: str, blocks: torch.Tensor) -> int:
    """The element count of a row of `blocks` (uint8 `[rows, row_bytes]`), checking both."""
    if qtype not in GGML_BLOCK_SIZES:
        raise ValueError(
            f"unknown GGML quantization type {qtype!r} (known: {sorted(GGML_BLOCK_SIZES)})"
        )
    block_elements, block_bytes = GGML_BLOCK_SIZES[qtype]
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % block_bytes:
        raise ValueError(
            f"{qtype} blocks must be uint8 [rows, a multiple of {block_bytes} bytes], "
            f"got {blocks.dtype} {tuple(blocks.shape)}"
        )
    return blocks.shape[1] // block_bytes * block_elements


def _fp16_field(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte `start` of every block of `[rows, num_blocks, block_bytes]`, as float32 `[..., 1]`."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """`[..., n]` uint8 -> `[..., 2 n]`: the n low nibbles, then the n high nibbles."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def _dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[..., 2:].contiguous().view(torch.int8).float() * _fp16_field(blocks, 0)


def _dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    quants = _nibbles(blocks[..., 2:]).to(torch.int8) - 8
    return _fp16_field(blocks, 0) * quants.float()


def _q4_k_scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins of each Q4_K block from its 12 packed bytes (`[..., 12]` -> `[..., 8]`)."""
    low, high, extra = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat([low & 0x3F, (extra & 0x0F) | ((low >> 2) & 0x30)], dim=-1)
    mins = torch.cat([high & 0x3F, (extra >> 4) | ((high >> 2) & 0x30)], dim=-1)
    return scales, mins


def _dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    scales, mins = _q4_k_scales_and_mins(blocks[..., 4:16])
    step = (_fp16_field(blocks, 0) * scales.float()).unsqueeze(-1)  # [rows, blocks, 8, 1]
    offset = (_fp16_field(blocks, 2) * mins.float()).unsqueeze(-1)
    chunks = blocks[..., 16:].unflatten(-1, (4, 32))  # 64 weights per chunk: low nibbles, then high
    quants = (
        _nibbles(chunks).unflatten(-1, (2, 32)).flatten(-3, -2).float()
    )  # [rows, blocks, 8, 32]
    return (step * quants - offset).flatten(-2)


def _dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    low_bits = _nibbles(blocks[..., 0:128].unflatten(-1, (2, 64)))  # [rows, blocks, half, 128]
    high_bits = blocks[..., 128:192].unflatten(-1, (2, 1, 32))
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
    high_bits = ((high_bits >> shifts) & 0x03).flatten(-2)  # [rows, blocks, half, 128]
    quants = (low_bits | (high_bits << 4)).to(torch.int8) - 32
    scales = blocks[..., 192:208].contiguous().view(torch.int8).float()
    step = (_fp16_field(blocks, 208) * scales).unsqueeze(-1)  # [rows, blocks, 16, 1]
    return (step * quants.float().flatten(-2).unflatten(-1, (16, 16))).flatten(-2)


_DEQUANTIZERS = {
    "Q8_0": _dequantize_q8_0,
    "Q4_0": _dequantize_q4_0,
    "Q4_K": _dequantize_q4_k,
    "Q6_K": _dequantize_q6_k,
}


def dequantize_reference(qtype: str, blocks: torch.Tensor) -> torch.Tensor:
    """uint8 `[rows, row_bytes]` GGUF rows of `qtype` as float32 `[rows, columns]`, in pure PyTorch; equal to
    `gguf.quants.dequantize` bit for bit (the same float32 products, in the same order)."""
    columns = _num_columns(qtype, blocks)
    _, block_bytes = GGML_BLOCK_SIZES[qtype]
    rows = blocks.shape[0]
    decoded = _DEQUANTIZERS[qtype](blocks.reshape(rows, -1, block_bytes))
    return decoded.reshape(rows, columns)


def activation_block_size(qtype: str) -> int | None:
    """Elements per activation scale of `qtype`'s products in this process: `ACTIVATION_BLOCK_SIZES[qtype]`, for
    Q8_0 32 under `KVFLOW_Q8_0_ACTIVATIONS` "int8" (the default) and None under "float32" (ValueError naming the
    variable for another value), None for other types."""
    if qtype == "Q8_0":
        return Q8_0_ACTIVATION_BLOCK if q8_0_activations() == "int8" else None
    return ACTIVATION_BLOCK_SIZES.get(qtype)


def quantize_activations_reference(
    qtype: str, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation quantization llama.cpp applies before a `qtype` product (Q4_0 and Q8_0: per 32 elements, Q4_K
    and Q6_K: per 256), in PyTorch: x `[..., K]` (any float dtype, taken as float32) in blocks of
    `activation_block_size(qtype)`, each with scale d = amax(|x|) / 127 and quants q = round(x / d)
    (round half to even, within [-127, 127]; an all-zero block gets d = 0 and q = 0). Returns int8 `[..., K]` and
    float32 `[..., K / block]`, equal to the C++ kernels' (the same float32 operations). ValueError for a type
    whose products keep fp32 x (Q8_0 under `KVFLOW_Q8_0_ACTIVATIONS=float32`), an unknown one, or K not a multiple
    of the block."""
    block = activation_block_size(qtype)
    if block is None:
        raise ValueError(
            f"{qtype!r} products do not quantize activations (those that do: "
            f"{sorted([*ACTIVATION_BLOCK_SIZES, 'Q8_0'])}, Q8_0 unless {Q8_0_ACTIVATIONS_ENV}=float32)"
        )
    if x.shape[-1] % block:
        raise ValueError(
            f"{qtype} quantizes x in blocks of {block}; {x.shape[-1]} features is not a multiple"
        )
    blocks = x.float().unflatten(-1, (-1, block))
    scales = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    quants = torch.where(scales > 0, torch.round(blocks / scales), 0.0).clamp_(-127, 127)
    return quants.to(torch.int8).flatten(-2), scales.squeeze(-1)


def fake_quantize_activations(qtype: str, x: torch.Tensor) -> torch.Tensor:
    """x `[..., K]` as a `qtype` product sees it, float32: `quantize_activations_reference`'s q * d for Q4_0, Q4_K,
    Q6_K and Q8_0 (unless `KVFLOW_Q8_0_ACTIVATIONS=float32`; what the tiled and dense paths multiply), x.float()
    otherwise."""
    block = activation_block_size(qtype)
    if block is None:
        return x.float()
    quants, scales = quantize_activations_reference(qtype, x)
    return (quants.float().unflatten(-1, (-1, block)) * scales.unsqueeze(-1)).flatten(-2)


def fake_quantize_int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x `[..., K]` as int8_linear's W8A8 kernel sees it, float32: each row quantized alone (d = amax / 127,
    q = round-half-even(x / d) within [-127, 127], an all-zero row stays zero), then q * d."""
    rows = x.float()
    scales = rows.abs().amax(dim=-1, keepdim=True) / 127.0
    quants = torch.where(scales > 0, torch.round(rows / scales), 0.0).clamp_(-127, 127)
    return quants * scales


def quantizes_activation_rows(weight_type: str, num_rows: int) -> bool:
    """Whether the kernel product of `weight_type` ("int8" or "Q8_0") on `num_rows` activation rows is W8A8 (x
    quantized per row, integer dots; `fake_quantize_int8_rows` is what it multiplies): the C++ kernels on an AVX-512
    VNNI CPU, where this process's plan (`quant_plan.quant_gemm_plan`) runs W8A8 for that many rows (statically:
    int8 above `QUANT_GEMV_MAX_ROWS` rows, Q8_0 above `QUANT_TILED_MAX_ROWS`; Q8_0's decode and small batches
    quantize x per 32 instead, or keep it float32 under `KVFLOW_Q8_0_ACTIVATIONS=float32`). The 4-bit types
    quantize x per block at every M."""
    if weight_type not in ("int8", "Q8_0"):
        raise ValueError(f"weight_type must be one of ['Q8_0', 'int8'], got {weight_type!r}")
    ops = _kernel_ops()
    return (
        ops is not None
        and ops.has_w8a8_kernels()
        and quant_gemm_plan(weight_type).product_for(num_rows) == W8A8
    )


def _kernel_ops(require_simd: bool = True):
    """The extension when loaded (and, with `require_simd`, built for AVX2 or AVX-512), else None."""
    ops = load_cpu_kernels()
    if ops is None or (require_simd and not ops.has_avx2()):
        return None
    return ops


def dequantize(
    qtype: str, blocks: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """`dequantize_reference` (same floats) through the C++ kernel when loaded, cast to `dtype`; for embedding
    rows (`dequantize(qtype, blocks[ids])`) and fallbacks."""
    _num_columns(qtype, blocks)
    ops = _kernel_ops(require_simd=False)
    if ops is None or not blocks.is_cpu:
        decoded = dequantize_reference(qtype, blocks)
    else:
        decoded = ops.ggml_dequantize(blocks.contiguous(), _GGML_TYPE_CODES[qtype])
    return decoded if dtype is torch.float32 else decoded.to(dtype)


def _reference_product(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`F.linear` in float32 of x against a float32 weight, cast back to x's dtype."""
    return F.linear(x.float(), weight, None if bias is None else bias.float()).to(x.dtype)


def _rows_of(x: torch.Tensor, num_columns: int) -> torch.Tensor:
    """x `[..., K]` as a 2-D `[M, K]` view (copied only when its rows are not contiguous)."""
    if x.shape[-1] != num_columns:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {num_columns} columns")
    if x.dim() == 2 and x.stride(-1) == 1:
        return x  # what the reshape would return, without making a view
    rows = x.reshape(-1, num_columns)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _shaped_like(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A product's `[M, N]` output in x's dtype and leading dims: `out.to(x.dtype).view(*x.shape[:-1], N)`, skipping
    the cast and the view where they would return `out`'s own values unchanged (x float32, x 2-D)."""
    if out.dtype is not x.dtype:
        out = out.to(x.dtype)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])


def _float_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.float().contiguous()


def _ggml_linear_reference(
    x: torch.Tensor, qtype: str, blocks: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    weight = dequantize_reference(qtype, blocks)
    product = F.linear(fake_quantize_activations(qtype, x), weight, _float_bias(bias))
    return product.to(x.dtype)


def run_product(
    weight_type: str,
    product: str,
    rows: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`rows` `[M, K]` (contiguous rows, float32 or bfloat16) times a `weight_type` weight on one of the plan's
    products (`quant_plan`: GEMV, TILED, W8A8, DEQUANT), float32 `[M, N]`; `scale` float32 for int8 weights,
    `bias` float32 or None. The C++ kernels must be loaded; the caller checked the product exists on this build."""
    ops = load_cpu_kernels()
    num_rows = rows.shape[0]
    if weight_type == "int8":
        assert scale is not None
        if product == DEQUANT:
            return F.linear(rows.float(), weight.float() * scale[:, None], bias)
        gemv_rows = num_rows if product == GEMV else num_rows - 1
        return ops.int8_linear(rows, weight, scale, bias, gemv_rows)
    code = _GGML_TYPE_CODES[weight_type]
    if product == W8A8:
        return ops.ggml_linear_w8a8(rows, weight, code, bias)
    if product == DEQUANT:
        x = fake_quantize_activations(weight_type, rows)
        return F.linear(x, ops.ggml_dequantize(weight, code), bias)
    gemv_rows = num_rows if product == GEMV else num_rows - 1
    return ops.ggml_linear(rows, weight, code, bias, gemv_rows)


def _ggml_linear_kernel(
    x: torch.Tensor, qtype: str, blocks: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    rows = _rows_of(x, _num_columns(qtype, blocks))
    product = quant_gemm_plan(qtype).product_for(rows.shape[0])
    out = run_product(qtype, product, rows, blocks, None, _float_bias(bias))
    return _shaped_like(out, x)


def _applies(x: torch.Tensor, packed: torch.Tensor) -> bool:
    # `is_cpu`, not `.device.type`: no device objects to make on every product's call.
    return (
        x.is_cpu
        and x.dtype in (torch.float32, torch.bfloat16)
        and packed.is_cpu
        and packed.is_contiguous()
    )


def ggml_linear(
    x: torch.Tensor, qtype: str, blocks: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(fake_quantize_activations(qtype, x), dequantize_reference(qtype, blocks), bias.float())` in x's
    dtype, within fp32 accumulation error (x int8-quantized per block for Q4_0, Q4_K, Q6_K and Q8_0; x itself, as
    float32, for Q8_0 under `KVFLOW_Q8_0_ACTIVATIONS=float32`): x `[..., K]` (float32 or bfloat16), blocks uint8
    `[N, ggml_row_bytes(qtype, K)]` contiguous, bias `[N]` or None; `[..., N]` in x's dtype. The C++ kernels when
    they apply, else that reference."""
    if _kernel_ops() is not None and _applies(x, blocks):
        return _ggml_linear_kernel(x, qtype, blocks, bias)
    return _ggml_linear_reference(x, qtype, blocks, bias)


def ggml_linear_for(qtype: str) -> LinearFn:
    """`ggml_linear` for `qtype` with the path chosen once (per layer, at load): `fn(x, blocks, bias)`. Its
    `__name__` (and `.path`: "kernel" or "reference") says which, for logs."""
    if qtype not in GGML_BLOCK_SIZES:
        raise ValueError(
            f"unknown GGML quantization type {qtype!r} (known: {sorted(GGML_BLOCK_SIZES)})"
        )
    use_kernel = kernels_in_use()
    implementation = _ggml_linear_kernel if use_kernel else _ggml_linear_reference

    def linear(
        x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if use_kernel and not _applies(x, blocks):
            return _ggml_linear_reference(x, qtype, blocks, bias)
        return implementation(x, qtype, blocks, bias)

    path = "kernel" if use_kernel else "reference"
    linear.__name__ = linear.__qualname__ = f"ggml_linear_{qtype}_{path}"
    linear.path = path  # type: ignore[attr-defined]
    return linear


def int8_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric weight-only int8 with one float32 scale per output channel (row) of `weight` `[N, K]`:
    scale = amax(|row|) / 127, q = round(w / scale) clamped to [-127, 127] (an all-zero row gets scale 1.0, so
    its quants are 0 and nothing divides by zero). Returns int8 `[N, K]` contiguous and float32 `[N]`."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            f"weight must be a floating-point [N, K] tensor, got {weight.dtype} {tuple(weight.shape)}"
        )
    as_float = weight.float()
    amax = (
        as_float.abs().amax(dim=1) if as_float.shape[1] else as_float.new_zeros(as_float.shape[0])
    )
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    quants = torch.round(as_float / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return quants, scale.contiguous()


def _int8_linear_reference(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return _reference_product(x, qweight.float() * scale.float()[:, None], bias)


def _int8_linear_kernel(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    rows = _rows_of(x, qweight.shape[1])
    product = quant_gemm_plan("int8").product_for(rows.shape[0])
    out = run_product("int8", product, rows, qweight, scale.float().contiguous(), _float_bias(bias))
    return _shaped_like(out, x)


def _int8_applies(x: torch.Tensor, qweight: torch.Tensor) -> bool:
    return _applies(x, qweight) and qweight.dtype == torch.int8 and qweight.dim() == 2


def int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x.float(), qweight.float() * scale[:, None], bias.float()).to(x.dtype)` within fp32 accumulation
    error (qweight, scale from `int8_quantize`), x taken as `fake_quantize_int8_rows(x)` where
    `quantizes_activation_rows("int8", rows)`; the C++ kernels when they apply, else that reference."""
    if _kernel_ops() is not None and _int8_applies(x, qweight):
        return _int8_linear_kernel(x, qweight, scale, bias)
    return _int8_linear_reference(x, qweight, scale, bias)


def int8_linear_for() -> LinearFn:
    """`int8_linear` with the path chosen once: `fn(x, qweight, scale, bias)`; `__name__` / `.path` say which."""
    use_kernel = kernels_in_use()
    implementation = _int8_linear_kernel if use_kernel else _int8_linear_reference

    def linear(
        x: torch.Tensor,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if use_kernel and not _int8_applies(x, qweight):
            return _int8_linear_reference(x, qweight, scale, bias)
        return implementation(x, qweight, scale, bias)

    path = "kernel" if use_kernel else "reference"
    linear.__name__ = linear.__qualname__ = f"int8_linear_{path}"
    linear.path = path  # type: ignore[attr-defined]
    return linear


def fused_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w13_type: str,
    w13_scale: torch.Tensor | None,
    w2: torch.Tensor,
    w2_type: str,
    w2_scale: torch.Tensor | None,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor | None:
    """A mixture-of-experts layer's quantized experts in one C++ call (csrc/quant_moe.cpp), else None (kernels off
    or not applicable: `FusedMoE.experts_quantized` then runs the same products one by one).

    `hidden_states [T, H]` (float32 or bfloat16); `w13 [E, 2I, ...]` and `w2 [E, H, ...]` as GGUF blocks of
    `w13_type` / `w2_type` (uint8, each row whole blocks) or "int8" (int8 rows, float32 scales `[E, rows]`);
    the routing's `topk_weights` and `topk_ids [T, k]`. Each expert's products over its tokens are the dense
    products `ggml_linear` / `int8_linear` pick for that many rows (the same thresholds), weighted and summed in
    float32, returned in hidden_states' dtype."""
    ops = _kernel_ops()
    if ops is None or not (_applies(hidden_states, w13) and _applies(hidden_states, w2)):
        return None
    if hidden_states.dim() != 2:
        return None
    rows = hidden_states if hidden_states.stride(1) == 1 else hidden_states.contiguous()
    return ops.quant_fused_moe(
        rows,
        w13,
        kernel_type_code(w13_type),
        w13_scale,
        w2,
        kernel_type_code(w2_type),
        w2_scale,
        topk_weights.to(torch.float32).contiguous(),
        topk_ids.to(torch.int64).contiguous(),
        QUANT_GEMV_MAX_ROWS,
        QUANT_TILED_MAX_ROWS,
    )
