"""Quantizers for llama.cpp's GGUF block formats: float32 weights -> the bytes of a GGUF tensor's rows (what the
GGUF writer, `kvflow.models.quantization.gguf_writer`, stores); and the decoding of the 5-bit types, which kvflow
runs as Q8_0 (`to_q8_0`, see `kvflow.models.quantization.gguf_plan`).

Q8_0, Q4_0 and Q5_0 come from `gguf.quants.quantize` (the gguf package's bit-exact port of ggml's reference
quantizers). Q4_K, Q5_K and Q6_K are written here from ggml's documented block layouts (ggml-common.h); a plain
min/max fit per sub-block, not llama.cpp's error-minimising search, so the bytes differ from llama.cpp's but decode
with any GGUF reader (tests check them against `gguf.quants.dequantize`):

* block_q4_K (144 bytes per 256 weights): fp16 d, fp16 dmin, 12 bytes packing eight 6-bit scales and eight 6-bit
  mins, 128 bytes of nibbles. Weight = d * scale_j * q - dmin * min_j for sub-block j (32 weights), q in 0..15.
  Byte i < 4 holds scale_i (low 6 bits) and the top 2 bits of scale_{i+4}; byte 4 + i holds min_i and the top 2
  bits of min_{i+4}; byte 8 + i holds the low 4 bits of scale_{i+4} (low nibble) and of min_{i+4} (high nibble).
  Nibble byte 32 * c + l holds weight 64 * c + l (low nibble) and weight 64 * c + 32 + l (high nibble).
* block_q6_K (210 bytes per 256 weights): ql[128] (low 4 bits), qh[64] (high 2 bits), int8 scales[16] (one per 16
  weights), fp16 d. Weight = d * scales[e // 16] * (q - 32), q in 0..63. In half h (128 weights) and l < 32:
  ql[64 h + l] holds the low bits of weights l (low nibble) and l + 64 (high nibble), ql[64 h + 32 + l] those of
  l + 32 and l + 96; qh[32 h + l] holds the high bits of l, l + 32, l + 64, l + 96 at bit 0, 2, 4, 6.
* block_q5_0 (22 bytes per 32 weights): fp16 d, a little-endian uint32 qh (bit j: the fifth bit of weight j), 16
  bytes of nibbles (byte j: weight j low, weight j + 16 high). Weight = d * (q - 16), q in 0..31.
* block_q5_K (176 bytes per 256 weights): Q4_K's d, dmin and 12 scale bytes, then qh[32] and qs[128]. Weight = d *
  scale_j * q - dmin * min_j, q in 0..31: the low 4 bits as Q4_K's nibbles (qs[32 c + l]: sub-block 2c low, 2c + 1
  high), the fifth bit of sub-block j's weight l is bit j of qh[l].
"""

from __future__ import annotations

import numpy as np

QK_K = 256
# Bytes of one block of the 5-bit types (32 and 256 weights).
Q5_0_BLOCK_BYTES = 22
Q5_K_BLOCK_BYTES = 176


def quantize(qtype: str, weights: np.ndarray) -> np.ndarray:
    """`weights` float32 `[rows, cols]` (cols a multiple of the type's block) as uint8 `[rows, row_bytes]`."""
    weights = np.ascontiguousarray(weights, dtype=np.float32)
    if weights.ndim != 2:
        raise ValueError(f"weights must be 2-D [rows, cols], got shape {weights.shape}")
    if qtype in ("Q8_0", "Q4_0", "Q5_0"):
        import gguf

        return np.asarray(gguf.quants.quantize(weights, gguf.GGMLQuantizationType[qtype]))
    rows, cols = weights.shape
    quantizers = {"Q4_K": _quantize_q4_k, "Q5_K": _quantize_q5_k, "Q6_K": _quantize_q6_k}
    if qtype not in quantizers or cols % QK_K:
        raise ValueError(f"cannot quantize {cols} columns to {qtype}")
    return quantizers[qtype](weights.reshape(-1, QK_K)).reshape(rows, -1)


def _fp16(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to fp16, as float32 (what a reader decodes) ."""
    return values.astype(np.float16).astype(np.float32)


def _affine_k_fit(superblocks: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K / Q5_K's fit of [B, 256] float32: per 32-weight sub-block an affine fit over [min(0, lo), hi] in
    `levels` steps. Returns (d and dmin as fp16 bytes [B, 2] each, the 12 packed scale bytes [B, 12], q [B, 8, 32])."""
    count = superblocks.shape[0]
    sub = superblocks.reshape(count, 8, 32)
    low = np.minimum(sub.min(axis=-1), 0.0)  # [B, 8]; the min term is subtracted, so kept <= 0
    high = np.maximum(sub.max(axis=-1), low)
    sub_scale = (high - low) / levels
    sub_min = -low
    d = _fp16(sub_scale.max(axis=-1) / 63.0)  # [B]
    dmin = _fp16(sub_min.max(axis=-1) / 63.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        scales = np.where(d[:, None] > 0, np.rint(sub_scale / d[:, None]), 0).clip(0, 63)
        mins = np.where(dmin[:, None] > 0, np.rint(sub_min / dmin[:, None]), 0).clip(0, 63)
        step = (d[:, None] * scales)[..., None]  # the decoded scale and min the reader will use
        offset = (dmin[:, None] * mins)[..., None]
        q = np.where(step > 0, np.rint((sub + offset) / step), 0).clip(0, levels).astype(np.uint8)
    scales = scales.astype(np.uint8)
    mins = mins.astype(np.uint8)
    packed_scales = np.empty((count, 12), dtype=np.uint8)
    packed_scales[:, 0:4] = (scales[:, 0:4] & 0x3F) | ((scales[:, 4:8] >> 4) << 6)
    packed_scales[:, 4:8] = (mins[:, 0:4] & 0x3F) | ((mins[:, 4:8] >> 4) << 6)
    packed_scales[:, 8:12] = (scales[:, 4:8] & 0x0F) | ((mins[:, 4:8] & 0x0F) << 4)
    d_bytes = d.astype(np.float16).view(np.uint8).reshape(count, 2)
    dmin_bytes = dmin.astype(np.float16).view(np.uint8).reshape(count, 2)
    return d_bytes, dmin_bytes, packed_scales, q


def _low_nibbles(q: np.ndarray) -> np.ndarray:
    """[B, 8, 32] -> [B, 128]: chunk c of 64 weights holds sub-blocks 2c (low nibble) and 2c + 1 (high)."""
    pairs = (q & 0x0F).reshape(q.shape[0], 4, 2, 32)
    return (pairs[:, :, 0, :] | (pairs[:, :, 1, :] << 4)).reshape(q.shape[0], 128)


def _quantize_q4_k(superblocks: np.ndarray) -> np.ndarray:
    """[B, 256] float32 -> [B, 144] uint8 (q in 0..15)."""
    d, dmin, packed_scales, q = _affine_k_fit(superblocks, 15)
    return np.concatenate([d, dmin, packed_scales, _low_nibbles(q)], axis=1)


def _quantize_q5_k(superblocks: np.ndarray) -> np.ndarray:
    """[B, 256] float32 -> [B, 176] uint8 (q in 0..31, the fifth bits in qh)."""
    d, dmin, packed_scales, q = _affine_k_fit(superblocks, 31)
    fifth = (q >> 4).astype(np.uint8)  # [B, 8, 32]
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for sub_block in range(8):
        qh |= fifth[:, sub_block, :] << sub_block
    return np.concatenate([d, dmin, packed_scales, qh, _low_nibbles(q)], axis=1)


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


# ---------------------------------------------------------------------------------------------- 5-bit decoding
def _blocks(data: np.ndarray, block_bytes: int, qtype: str) -> np.ndarray:
    data = np.ascontiguousarray(data, dtype=np.uint8)
    if data.ndim != 2 or data.shape[1] % block_bytes:
        raise ValueError(
            f"{qtype} rows must be whole {block_bytes}-byte blocks, got shape {data.shape}"
        )
    return data.reshape(-1, block_bytes)


def _q5_0_values(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[N, 22] -> (d float32 [N, 1], q - 16 as int8 [N, 32])."""
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    high_bits = blocks[:, 2:6].copy().view("<u4")  # [N, 1]
    fifth = ((high_bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    nibbles = blocks[:, 6:22]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1) | (fifth << 4)
    return d, (q.astype(np.int16) - 16).astype(np.int8)


def _k_scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 scale bytes of Q4_K / Q5_K -> (scales, mins) [N, 8] float32."""
    scales = np.empty((packed.shape[0], 8), dtype=np.uint8)
    mins = np.empty_like(scales)
    scales[:, 0:4] = packed[:, 0:4] & 0x3F
    mins[:, 0:4] = packed[:, 4:8] & 0x3F
    scales[:, 4:8] = (packed[:, 8:12] & 0x0F) | ((packed[:, 0:4] >> 6) << 4)
    mins[:, 4:8] = (packed[:, 8:12] >> 4) | ((packed[:, 4:8] >> 6) << 4)
    return scales.astype(np.float32), mins.astype(np.float32)


def _dequantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    """[N, 176] -> [N, 256] float32."""
    count = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    scales, mins = _k_scales_and_mins(blocks[:, 4:16])
    qh, qs = blocks[:, 16:48], blocks[:, 48:176].reshape(count, 4, 32)
    low = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(
        count, 8, 32
    )  # sub-block 2c + h of chunk c
    fifth = np.stack([(qh >> sub_block) & 1 for sub_block in range(8)], axis=1)
    q = (low | (fifth << 4)).astype(np.float32)
    values = (d * scales)[..., None] * q - (dmin * mins)[..., None]
    return values.reshape(count, QK_K)


def dequantize(qtype: str, data: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_K rows (uint8 `[rows, row_bytes]`) as float32 `[rows, columns]`."""
    if qtype == "Q5_0":
        d, q = _q5_0_values(_blocks(data, Q5_0_BLOCK_BYTES, qtype))
        values = d * q.astype(np.float32)
    elif qtype == "Q5_K":
        values = _dequantize_q5_k(_blocks(data, Q5_K_BLOCK_BYTES, qtype))
    else:
        raise ValueError(f"dequantize reads Q5_0 and Q5_K, not {qtype}")
    return values.reshape(data.shape[0], -1)


def to_q8_0(qtype: str, data: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_K rows as Q8_0 rows (uint8 `[rows, columns // 32 * 34]`). Q5_0 -> Q8_0 is exact: the same fp16 d
    and q - 16 (in -16..15) as the int8. Q5_K's sub-blocks are affine (d * scale * q - dmin * min), which Q8_0's
    symmetric blocks cannot hold exactly: its weights are decoded and requantized (gguf-py's Q8_0 quantizer), adding
    about half a Q8_0 step (max |w| / 254 of the 32-weight block, plus the fp16 rounding of its
    scale) to each weight."""
    if qtype == "Q5_0":
        blocks = _blocks(data, Q5_0_BLOCK_BYTES, qtype)
        _, q = _q5_0_values(blocks)
        q8 = np.concatenate([blocks[:, 0:2], q.view(np.uint8)], axis=1)
        return q8.reshape(data.shape[0], -1)
    return quantize("Q8_0", dequantize(qtype, data))
