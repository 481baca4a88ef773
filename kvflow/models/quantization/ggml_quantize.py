"""Quantizers for llama.cpp's GGUF block formats: float32 weights -> the bytes of a GGUF tensor's rows (what the
GGUF writer, `kvflow.models.quantization.gguf_writer`, stores).

Q8_0 and Q4_0 come from `gguf.quants.quantize` (the gguf package's bit-exact port of ggml's reference quantizers).
Q4_K and Q6_K are written here from ggml's documented block layouts (ggml-common.h); a plain min/max fit per
sub-block, not llama.cpp's error-minimising search, so the bytes differ from llama.cpp's but decode with any GGUF
reader (tests check them against `gguf.quants.dequantize`):

* block_q4_K (144 bytes per 256 weights): fp16 d, fp16 dmin, 12 bytes packing eight 6-bit scales and eight 6-bit
  mins, 128 bytes of nibbles. Weight = d * scale_j * q - dmin * min_j for sub-block j (32 weights), q in 0..15.
  Byte i < 4 holds scale_i (low 6 bits) and the top 2 bits of scale_{i+4}; byte 4 + i holds min_i and the top 2
  bits of min_{i+4}; byte 8 + i holds the low 4 bits of scale_{i+4} (low nibble) and of min_{i+4} (high nibble).
  Nibble byte 32 * c + l holds weight 64 * c + l (low nibble) and weight 64 * c + 32 + l (high nibble).
* block_q6_K (210 bytes per 256 weights): ql[128] (low 4 bits), qh[64] (high 2 bits), int8 scales[16] (one per 16
  weights), fp16 d. Weight = d * scales[e // 16] * (q - 32), q in 0..63. In half h (128 weights) and l < 32:
  ql[64 h + l] holds the low bits of weights l (low nibble) and l + 64 (high nibble), ql[64 h + 32 + l] those of
  l + 32 and l + 96; qh[32 h + l] holds the high bits of l, l + 32, l + 64, l + 96 at bit 0, 2, 4, 6.
"""

from __future__ import annotations

import numpy as np

QK_K = 256


def quantize(qtype: str, weights: np.ndarray) -> np.ndarray:
    """`weights` float32 `[rows, cols]` (cols a multiple of the type's block) as uint8 `[rows, row_bytes]`."""
    weights = np.ascontiguousarray(weights, dtype=np.float32)
    if weights.ndim != 2:
        raise ValueError(f"weights must be 2-D [rows, cols], got shape {weights.shape}")
    if qtype in ("Q8_0", "Q4_0"):
        import gguf

        return np.asarray(gguf.quants.quantize(weights, gguf.GGMLQuantizationType[qtype]))
    rows, cols = weights.shape
    if qtype not in ("Q4_K", "Q6_K") or cols % QK_K:
        raise ValueError(f"cannot quantize {cols} columns to {qtype}")
    superblocks = weights.reshape(-1, QK_K)
    packed = _quantize_q4_k(superblocks) if qtype == "Q4_K" else _quantize_q6_k(superblocks)
    return packed.reshape(rows, -1)


def _fp16(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to fp16, as float32 (what a reader decodes) ."""
    return values.astype(np.float16).astype(np.float32)


def _quantize_q4_k(superblocks: np.ndarray) -> np.ndarray:
    """[B, 256] float32 -> [B, 144] uint8: per 32-weight sub-block an affine fit over [min(0, lo), hi]."""
    count = superblocks.shape[0]
    sub = superblocks.reshape(count, 8, 32)
    low = np.minimum(sub.min(axis=-1), 0.0)  # [B, 8]; the min term is subtracted, so kept <= 0
    high = np.maximum(sub.max(axis=-1), low)
    sub_scale = (high - low) / 15.0
    sub_min = -low
    d = _fp16(sub_scale.max(axis=-1) / 63.0)  # [B]
    dmin = _fp16(sub_min.max(axis=-1) / 63.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        scales = np.where(d[:, None] > 0, np.rint(sub_scale / d[:, None]), 0).clip(0, 63)
        mins = np.where(dmin[:, None] > 0, np.rint(sub_min / dmin[:, None]), 0).clip(0, 63)
        step = (d[:, None] * scales)[..., None]  # the decoded scale and min the reader will use
        offset = (dmin[:, None] * mins)[..., None]
        q = np.where(step > 0, np.rint((sub + offset) / step), 0).clip(0, 15).astype(np.uint8)
    scales = scales.astype(np.uint8)
    mins = mins.astype(np.uint8)
    packed_scales = np.empty((count, 12), dtype=np.uint8)
    packed_scales[:, 0:4] = (scales[:, 0:4] & 0x3F) | ((scales[:, 4:8] >> 4) << 6)
    packed_scales[:, 4:8] = (mins[:, 0:4] & 0x3F) | ((mins[:, 4:8] >> 4) << 6)
    packed_scales[:, 8:12] = (scales[:, 4:8] & 0x0F) | ((mins[:, 4:8] & 0x0F) << 4)
    pairs = q.reshape(
        count, 4, 2, 32
    )  # chunk c of 64 weights: sub-blocks 2c (low nibble), 2c + 1 (high)
    nibbles = (pairs[:, :, 0, :] | (pairs[:, :, 1, :] << 4)).reshape(count, 128)
    return np.concatenate(
        [
            d.astype(np.float16).view(np.uint8).reshape(count, 2),
            dmin.astype(np.float16).view(np.uint8).reshape(count, 2),
            packed_scales,
            nibbles,
        ],
        axis=1,
    )


def _quantize_q6_k(superblocks: np.ndarray) -> np.ndarray:
    """[B, 256] float32 -> [B, 210] uint8: per 16-weight group a symmetric fit, q - 32 in [-32, 31]."""
    count = superblocks.shape[0]
    groups = superblocks.reshape(count, 16, 16)
    group_scale = np.abs(groups).max(axis=-1) / 31.0  # [B, 16]
    d = _fp16(group_scale.max(axis=-1) / 127.0)  # [B]
    with np.errstate(divide="ignore", invalid="ignore"):
        scales = np.where(d[:, None] > 0, np.rint(group_scale / d[:, None]), 0).clip(-128, 127)
        step = (d[:, None] * scales)[..., None]
        q = np.where(step > 0, np.rint(groups / step), 0).clip(-32, 31)
    q = (
        (q + 32).astype(np.uint8).reshape(count, 2, 4, 32)
    )  # half h, quarter s (weights 32 s + l of the half)
    low, high = q & 0x0F, q >> 4
    ql = np.concatenate(
        [low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=-1
    ).reshape(count, 128)
    qh = (
        high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    ).reshape(count, 64)
    return np.concatenate(
        [
            ql,
            qh,
            scales.astype(np.int8).view(np.uint8),
            d.astype(np.float16).view(np.uint8).reshape(count, 2),
        ],
        axis=1,
    )
