// Quantized-weight kernels: llama.cpp's GGUF blocks (Q8_0, Q4_0, Q4_K, Q6_K) and weight-only int8 per channel.
//
// * Dequantization (ggml_dequantize): the same float32 operations, in the same order, as gguf.quants.dequantize
//   (and kvflow/kernels/quant.py's dequantize_reference), so the floats are identical; -ffp-contract=off keeps
//   `step * q - offset` from being fused.
// * Activations: Q4_0, Q4_K and Q6_K products quantize x as llama.cpp does (per 32 / 256 / 256 columns:
//   d = amax / 127, q = round-half-even(x / d)); Q8_0 and int8 keep fp32 x. The GEMV multiplies the int8 quants;
//   the tiled product (and quant.py's dequantize + torch path) runs on q * d, so every M computes the same sum.
// * GEMV (M <= gemv_max_rows activation rows, decode): works on the blocks, never writing dequantized weights.
//   Q8_0: x widened to fp32 once, each block's quants widened in registers and times d (the exact dequantized
//   weights), dot(x, d q); 16 lanes at a time on AVX-512 builds. Q4_0 / Q4_K / Q6_K:
//   integer dots (maddubs: u8 x s8 pairs -> int16; madd: int16 x int16 multipliers -> int32) converted to float
//   once per block: Q4_0 d_w d_x sum((q - 8) q_x); Q4_K d_w d_x sum_j sc_j dot(q_j, q_x_j) - dmin d_x sum_j m_j
//   sum(q_x_j) (the scales as madd multipliers, the per-16 sums of q_x computed once per call); Q6_K d_w d_x
//   sum_g sc_g (dot(q_g, q_x_g) - 32 sum(q_x_g)). int8: dot(x, q) * scale[n] at the end. Threads split the
//   weight rows into contiguous bands, so each weight byte streams from memory once. On AVX-512 VNNI builds the
//   K-quants take 64 quants per instruction (maddubs, then vpdpwssd: the scale multiply and the int32 add in one),
//   the same integers summed in 16 lanes instead of 8: 1.07-1.3x at M >= 8, the same speed at M = 1 (memory).
// * int8 W8A8 (more rows than the GEMV's, AVX-512 VNNI builds): x quantized per row, exact int32 dots
//   (vpdpbusd), see int8_gemm_vnni.
// * Q4_0 / Q4_K / Q6_K above kInterleavedAboveRows rows (AVX-512 VNNI builds): the same integer product on 16-row
//   weight tiles repacked in cache so that lanes are weight rows (one vpdpbusd per 64 products), see
//   interleaved_product.
// * Tiled product (more rows, prefill): per thread, tiles of kTileRows weight rows and kTileK columns are
//   dequantized into a thread-local fp32 buffer (L1/L2) and every x row runs against it in 4 x 3 register
//   blocks: the weights are read from memory once per call whatever M is.
//
// Every output element is computed by one thread in an order that does not depend on the thread count (band and
// tile boundaries only decide which thread, never how a row is summed), so results are identical for any
// number of threads. The SIMD paths need AVX2 + FMA (also used on AVX-512 builds); other builds get portable
// loops that the compiler vectorises.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "common.h"
#include "cpu_features.h"
#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#define KVFLOW_QUANT_SIMD 1
#include <immintrin.h>
#elif defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(KVFLOW_QUANT_SIMD) && defined(KVFLOW_AVX512) && defined(__AVX512VNNI__)
// 512-bit integer dots for the K-quants: maddubs (u8 x s8 pairs -> int16) then vpdpwssd (int16 pairs times the
// int16 scales, added to int32 lanes in the same instruction).
#define KVFLOW_QUANT_VNNI 1
#endif

namespace kvflow {
namespace {

constexpr int64_t kQK = 256;  // elements of a K-quant super-block

inline float fp16_to_float(const uint8_t* bytes) {
  uint16_t half;
  std::memcpy(&half, bytes, sizeof(half));
#ifdef __F16C__
  return _cvtsh_ss(half);
#else
  const uint32_t sign = static_cast<uint32_t>(half & 0x8000u) << 16;
  const uint32_t exponent = (half >> 10) & 0x1fu, mantissa = half & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31)
    bits = sign | 0x7f800000u | (mantissa << 13);
  else
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  float result;
  std::memcpy(&result, &bits, sizeof(result));
  return result;
#endif
}

// The eight 6-bit scales and mins of a Q4_K block from its 12 packed bytes.
inline void q4_k_scales_and_mins(const uint8_t* packed, uint8_t scales[8], uint8_t mins[8]) {
  for (int j = 0; j < 4; ++j) {
    scales[j] = packed[j] & 63;
    mins[j] = packed[j + 4] & 63;
    scales[j + 4] = static_cast<uint8_t>((packed[j + 8] & 0x0F) | ((packed[j] >> 6) << 4));
    mins[j + 4] = static_cast<uint8_t>((packed[j + 8] >> 4) | ((packed[j + 4] >> 6) << 4));
  }
}

// ---- exact dequantization of one block ----

void dequantize_q8_0(const uint8_t* block, float* out) {
  const float d = fp16_to_float(block);
  const int8_t* quants = reinterpret_cast<const int8_t*>(block + 2);
  for (int i = 0; i < 32; ++i) out[i] = static_cast<float>(quants[i]) * d;
}

void dequantize_q4_0(const uint8_t* block, float* out) {
  const float d = fp16_to_float(block);
  for (int i = 0; i < 16; ++i) {
    out[i] = d * static_cast<float>((block[2 + i] & 0x0F) - 8);
    out[i + 16] = d * static_cast<float>((block[2 + i] >> 4) - 8);
  }
}

void dequantize_q4_k(const uint8_t* block, float* out) {
  const float d = fp16_to_float(block), dmin = fp16_to_float(block + 2);
  uint8_t scales[8], mins[8];
  q4_k_scales_and_mins(block + 4, scales, mins);
  const uint8_t* quants = block + 16;
  for (int c = 0; c < 4; ++c) {
    const float step_low = d * static_cast<float>(scales[2 * c]), offset_low = dmin * static_cast<float>(mins[2 * c]);
    const float step_high = d * static_cast<float>(scales[2 * c + 1]);
    const float offset_high = dmin * static_cast<float>(mins[2 * c + 1]);
    for (int l = 0; l < 32; ++l) {
      out[64 * c + l] = step_low * static_cast<float>(quants[32 * c + l] & 0x0F) - offset_low;
      out[64 * c + 32 + l] = step_high * static_cast<float>(quants[32 * c + l] >> 4) - offset_high;
    }
  }
}

void dequantize_q6_k(const uint8_t* block, float* out) {
  const uint8_t* low = block;
  const uint8_t* high = block + 128;
  const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
  const float d = fp16_to_float(block + 208);
  float step[16];
  for (int g = 0; g < 16; ++g) step[g] = d * static_cast<float>(scales[g]);
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = low + 64 * h;
    const uint8_t* qh = high + 32 * h;
    float* o = out + 128 * h;
    const float* s = step + 8 * h;
    for (int l = 0; l < 32; ++l) {
      const int q0 = (ql[l] & 0x0F) | ((qh[l] & 3) << 4);
      const int q1 = (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4);
      const int q2 = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
      const int q3 = (ql[l + 32] >> 4) | ((qh[l] >> 6) << 4);
      o[l] = s[l / 16] * static_cast<float>(q0 - 32);
      o[l + 32] = s[2 + l / 16] * static_cast<float>(q1 - 32);
      o[l + 64] = s[4 + l / 16] * static_cast<float>(q2 - 32);
      o[l + 96] = s[6 + l / 16] * static_cast<float>(q3 - 32);
    }
  }
}

using DequantizeBlock = void (*)(const uint8_t*, float*);

DequantizeBlock block_dequantizer(int type) {
  switch (type) {
    case kGgmlQ8_0: return dequantize_q8_0;
    case kGgmlQ4_0: return dequantize_q4_0;
    case kGgmlQ4_K: return dequantize_q4_k;
    default: return dequantize_q6_k;
  }
}

// x rows as fp32, `stride` floats apart (K rounded up to a multiple of 8, zero padded).
template <typename T>
std::vector<float> widen_rows(const T* x, int64_t M, int64_t K, int64_t x_stride, int64_t stride) {
  std::vector<float> xf(static_cast<size_t>(M * stride), 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xf[m * stride + k] = to_float<T>(x[m * x_stride + k]);
  return xf;
}

inline int64_t padded8(int64_t count) { return (count + 7) / 8 * 8; }

// ---- activation quantization (Q4_0, Q4_K, Q6_K) ----

// Elements per activation scale for `type`: its weight block (32 for Q4_0, 256 for the K-quants); 0 for Q8_0,
// whose products keep fp32 activations.
int64_t activation_block(int type) {
  switch (type) {
    case kGgmlQ4_0: return 32;
    case kGgmlQ4_K:
    case kGgmlQ6_K: return kQK;
    default: return 0;
  }
}

// x[0:count] as int8 quants; returns the scale d = amax / 127 (q = round-half-even(x / d), 0 when d = 0): the
// same float32 operations as quant.py's quantize_activations_reference, so the quants are identical.
float quantize_block(const float* x, int64_t count, int8_t* quants) {
  float amax = 0.f;
  for (int64_t i = 0; i < count; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.f;
  for (int64_t i = 0; i < count; ++i)
    quants[i] = d > 0.f ? static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x[i] / d)))) : 0;
  return d;
}

// The rows of x (fp32, `xs` floats apart) quantized per `block` columns, with the per-16 sums of the quants
// (Q4_K's min term, Q6_K's -32 offset).
struct QuantizedActivations {
  int64_t K, block;
  std::vector<int8_t> quants;  // [M, K]
  std::vector<float> scales;   // [M, K / block]
  std::vector<int16_t> sums;   // [M, K / 16]; |sum| <= 16 * 127
  // [M, K / 32]: d_x * the sum of each 32 quants (the K-quants' blocks only; Q4_K's min term on VNNI builds).
  std::vector<float> scaled_sums;

  QuantizedActivations(const float* xf, int64_t M, int64_t K_, int64_t xs, int64_t block_)
      : K(K_), block(block_), quants(static_cast<size_t>(M * K_)), scales(static_cast<size_t>(M * K_ / block_)),
        sums(static_cast<size_t>(M * K_ / 16)), scaled_sums(block_ == kQK ? static_cast<size_t>(M * K_ / 32) : 0) {
    for (int64_t m = 0; m < M; ++m) {
      int8_t* q = quants.data() + m * K;
      for (int64_t b = 0; b < K / block; ++b)
        scales[m * (K / block) + b] = quantize_block(xf + m * xs + b * block, block, q + b * block);
      for (int64_t j = 0; j < K / 16; ++j) {
        int total = 0;
        for (int i = 0; i < 16; ++i) total += q[16 * j + i];
        sums[m * (K / 16) + j] = static_cast<int16_t>(total);
      }
      if (block != kQK) continue;
      for (int64_t j = 0; j < K / 32; ++j) {
        const int16_t* pair = sums.data() + m * (K / 16) + 2 * j;
        scaled_sums[m * (K / 32) + j] = scales[m * (K / kQK) + j / 8] * static_cast<float>(pair[0] + pair[1]);
      }
    }
  }
};

// Replaces x's rows (fp32, `xs` floats apart) by their quantized values q * d: what the integer GEMV computes
// with, for the products that run in fp32.
void fake_quantize_rows(float* xf, int64_t M, int64_t K, int64_t xs, int64_t block) {
  std::vector<int8_t> quants(static_cast<size_t>(block));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < K / block; ++b) {
      float* x = xf + m * xs + b * block;
      const float d = quantize_block(x, block, quants.data());
      for (int64_t i = 0; i < block; ++i) x[i] = static_cast<float>(quants[i]) * d;
    }
}

// Splits `count` units among up to `num_threads` threads: thread t of nt gets [begin, end).
inline void thread_range(int64_t count, int t, int nt, int64_t& begin, int64_t& end) {
  begin = count * t / nt;
  end = count * (t + 1) / nt;
}

#ifdef KVFLOW_QUANT_SIMD
// How far ahead of the current block each weight row is prefetched.
constexpr int kPrefetchBytes = 1024;

inline float sum8(__m256 values) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(values), _mm256_extractf128_ps(values, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
  return _mm_cvtss_f32(sum);
}

inline __m256 widen8(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)); }

// 32 int8 values as four vectors of 8 floats.
inline void widen32(__m256i bytes, __m256 out[4]) {
  const __m128i low = _mm256_castsi256_si128(bytes), high = _mm256_extracti128_si256(bytes, 1);
  out[0] = widen8(low);
  out[1] = widen8(_mm_srli_si128(low, 8));
  out[2] = widen8(high);
  out[3] = widen8(_mm_srli_si128(high, 8));
}

// dot(x[0:32], q) as 8 lanes (two chains: a shorter latency per block).
inline __m256 dot32(const float* x, const __m256 q[4]) {
  __m256 t0 = _mm256_mul_ps(_mm256_loadu_ps(x), q[0]);
  __m256 t1 = _mm256_mul_ps(_mm256_loadu_ps(x + 16), q[2]);
  t0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), q[1], t0);
  t1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + 24), q[3], t1);
  return _mm256_add_ps(t0, t1);
}

inline __m256i low_nibbles(__m256i bytes) { return _mm256_and_si256(bytes, _mm256_set1_epi8(0x0F)); }
inline __m256i high_nibbles(__m256i bytes) {
  return _mm256_and_si256(_mm256_srli_epi16(bytes, 4), _mm256_set1_epi8(0x0F));
}

// x rows in fp32 (Q8_0's GEMV): `x` at row m0's first column, rows `stride` floats apart.
struct FloatRows {
  const float* x;
  int64_t stride;
  FloatRows at(int64_t m0) const { return {x + m0 * stride, stride}; }
};

// x rows quantized (QuantizedActivations below) for the integer GEMVs, from row m0 on.
struct QuantRows {
  const int8_t* quants;       // rows quant_stride apart
  const float* scales;        // one per activation block, rows scale_stride apart
  const int16_t* sums;        // per 16 quants, rows sum_stride apart
  const float* scaled_sums;   // d_x * sum per 32 quants (K-quants), rows sum_stride / 2 apart
  int64_t quant_stride, scale_stride, sum_stride;
  QuantRows at(int64_t m0) const {
    return {quants + m0 * quant_stride, scales + m0 * scale_stride, sums + m0 * sum_stride,
            scaled_sums ? scaled_sums + m0 * (sum_stride / 2) : nullptr, quant_stride, scale_stride, sum_stride};
  }
};

// Accumulator vectors: 8 fp32 lanes (AVX2), 16 on AVX-512 builds for the blocks that use them.
inline __m256 zero_like(__m256) { return _mm256_setzero_ps(); }
inline float reduce(__m256 values) { return sum8(values); }
#ifdef KVFLOW_AVX512
inline __m512 zero_like(__m512) { return _mm512_setzero_ps(); }
inline float reduce(__m512 values) { return _mm512_reduce_add_ps(values); }
#endif

// Each block kind accumulates block b of one weight row (`block`) against MT rows of x into acc[m] (Acc lanes).
// Q8_0: each quant times d is the dequantized weight exactly (an 11-bit fp16 significand times 8 bits fits
// fp32's 24), so acc gathers x * w as the dequantized float32 model's product does, in another order.
struct Q8_0Block {
  static constexpr int kElements = 32, kBytes = 34;
#ifdef KVFLOW_AVX512
  // AVX-512: 16 quants sign-extended to int32 straight from memory, two per block: a third of the AVX2
  // path's instructions (which widens 8 at a time from one 256-bit load).
  using Acc = __m512;
  template <int MT>
  static void accumulate(const uint8_t* block, const FloatRows& rows, int64_t b, __m512* acc) {
    const __m512 d = _mm512_set1_ps(fp16_to_float(block));
    const __m128i* quants = reinterpret_cast<const __m128i*>(block + 2);
    const __m512 w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(quants))));
    const __m512 w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(quants + 1))));
    const float* x = rows.x + b * kElements;
    for (int m = 0; m < MT; ++m) {
      const float* xm = x + m * rows.stride;
      acc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xm + 16), w1, _mm512_fmadd_ps(_mm512_loadu_ps(xm), w0, acc[m]));
    }
  }
#else
  using Acc = __m256;
  template <int MT>
  static void accumulate(const uint8_t* block, const FloatRows& rows, int64_t b, __m256* acc) {
    const __m256 d = _mm256_set1_ps(fp16_to_float(block));
    __m256 q[4];
    widen32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2)), q);
    for (int i = 0; i < 4; ++i) q[i] = _mm256_mul_ps(d, q[i]);
    const float* x = rows.x + b * kElements;
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_add_ps(acc[m], dot32(x + m * rows.stride, q));
  }
#endif
};

// 16 int16 lanes of u8 x s8 pair sums (no saturation: |u| <= 63, |s| <= 127) times int16 multipliers, pairs
// summed: 8 int32 lanes.
inline __m256i dot_scaled(__m256i unsigned_bytes, const int8_t* signed_bytes, __m256i multipliers) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(signed_bytes));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(unsigned_bytes, x), multipliers);
}

// Q4_0 against x quantized per 32: d_w * d_x * sum((q_w - 8) * q_x), the -8 applied to the weight bytes and
// the product taken as |q_w - 8| * (q_x with q_w - 8's sign), maddubs needing one unsigned operand (the same
// integer as sum(q_w * q_x) - 8 * sum(q_x)).
struct Q4_0Block {
  using Acc = __m256;
  static constexpr int kElements = 32, kBytes = 18;
  template <int MT>
  static void accumulate(const uint8_t* block, const QuantRows& rows, int64_t b, __m256* acc) {
    const float d = fp16_to_float(block);
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);  // elements 0-15 | 16-31
    const __m256i quants = _mm256_sub_epi8(low_nibbles(both), _mm256_set1_epi8(8));
    const __m256i magnitudes = _mm256_abs_epi8(quants), ones = _mm256_set1_epi16(1);
    for (int m = 0; m < MT; ++m) {
      const __m256i x = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(rows.quants + m * rows.quant_stride + b * kElements));
      const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitudes, _mm256_sign_epi8(x, quants)), ones);
      const __m256 scale = _mm256_set1_ps(d * rows.scales[m * rows.scale_stride + b]);
      acc[m] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(dot), acc[m]);
    }
  }
};

// int16 multipliers selecting byte pairs (2j, 2j + 1) of each 128-bit lane: one int16 broadcast per lane.
inline __m256i int16_lane(int j) { return _mm256_set1_epi16(static_cast<int16_t>(((2 * j + 1) << 8) | (2 * j))); }

// A Q4_K block's eight 6-bit scales and mins as bytes 0-7 of two vectors (q4_k_scales_and_mins on whole words).
inline void q4_k_scales_and_mins_simd(const uint8_t* block, __m128i& scales8, __m128i& mins8) {
  uint32_t packed[3];
  std::memcpy(packed, block + 4, sizeof(packed));
  const uint32_t scales_low = packed[0] & 0x3F3F3F3Fu, mins_low = packed[1] & 0x3F3F3F3Fu;
  const uint32_t scales_high = (packed[2] & 0x0F0F0F0Fu) | ((packed[0] >> 2) & 0x30303030u);
  const uint32_t mins_high = ((packed[2] >> 4) & 0x0F0F0F0Fu) | ((packed[1] >> 2) & 0x30303030u);
  scales8 = _mm_set_epi32(0, 0, static_cast<int>(scales_high), static_cast<int>(scales_low));
  mins8 = _mm_set_epi32(0, 0, static_cast<int>(mins_high), static_cast<int>(mins_low));
}

// Q4_K against x quantized per 256: d_w * d_x * sum_j sc_j * dot(q_j, q_x_j) - dmin * d_x * sum_j m_j * sum(q_x_j)
// over the 8 sub-blocks j of 32, both sums integer (the scales as int16 multipliers, the mins against the
// per-16 sums of the quants), two float conversions per super-block.
struct Q4_KBlock {
  static constexpr int kElements = 256, kBytes = 144;
#ifdef KVFLOW_QUANT_VNNI
  // AVX-512 VNNI: chunk c's 32 bytes widened to 64 quants [sub-block 2c | 2c + 1], which are x's 64 quants at
  // 64 c in order: one x load, one maddubs and one vpdpwssd (scale [sc_2c x 16 | sc_2c+1 x 16]) per chunk and
  // x row, a third of the AVX2 path's instructions.
  using Acc = __m512;
  template <int MT>
  static void accumulate(const uint8_t* block, const QuantRows& rows, int64_t b, __m512* acc) {
    const float d = fp16_to_float(block), dmin = fp16_to_float(block + 2);
    __m128i scales8, mins8;
    q4_k_scales_and_mins_simd(block, scales8, mins8);
    const __m512i scales16 = _mm512_cvtepu8_epi16(_mm256_zextsi128_si256(scales8));  // s0..s7 in lanes 0-7
    // dmin * m_j in lanes 0-7: the min term is sum_j (dmin m_j) (d_x sum(q_x_j)), one multiply-add per x row.
    const __m512 dmin_mins = _mm512_zextps256_ps512(
        _mm256_mul_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mins8))));
    __m512i sums[MT];
    for (int m = 0; m < MT; ++m) sums[m] = _mm512_setzero_si512();
    const int8_t* x = rows.quants + b * kElements;
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      const __m512i bytes =
          _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16 + 32 * c)));
      const __m512i quants = _mm512_and_si512(_mm512_mask_srli_epi16(bytes, 0xFFFF0000u, bytes, 4), nibble);
      const __m512i pick = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16(static_cast<int16_t>(2 * c)),
                                                   _mm512_set1_epi16(static_cast<int16_t>(2 * c + 1)));
      const __m512i scale = _mm512_permutexvar_epi16(pick, scales16);
      for (int m = 0; m < MT; ++m) {
        const __m512i xm = _mm512_loadu_si512(x + m * rows.quant_stride + 64 * c);
        sums[m] = _mm512_dpwssd_epi32(sums[m], _mm512_maddubs_epi16(quants, xm), scale);
      }
    }
    for (int m = 0; m < MT; ++m) {
      const float dx = rows.scales[m * rows.scale_stride + b];
      const __m512 x_sums = _mm512_zextps256_ps512(
          _mm256_loadu_ps(rows.scaled_sums + m * (rows.sum_stride / 2) + b * (kElements / 32)));
      acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(d * dx), _mm512_cvtepi32_ps(sums[m]), acc[m]);
      acc[m] = _mm512_fnmadd_ps(dmin_mins, x_sums, acc[m]);
    }
  }
#else
  using Acc = __m256;
  template <int MT>
  static void accumulate(const uint8_t* block, const QuantRows& rows, int64_t b, __m256* acc) {
    const float d = fp16_to_float(block), dmin = fp16_to_float(block + 2);
    __m128i scales8, mins8;
    q4_k_scales_and_mins_simd(block, scales8, mins8);
    const __m256i scales16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(scales8));  // s0..s7 in each lane
    const __m256i mins_per16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mins8, mins8));  // m0 m0 m1 m1 .. m7 m7
    __m256i sums[MT];
    for (int m = 0; m < MT; ++m) sums[m] = _mm256_setzero_si256();
    const int8_t* x = rows.quants + b * kElements;
    for (int c = 0; c < 4; ++c) {  // 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high ones
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16 + 32 * c));
      const __m256i low = low_nibbles(bytes), high = high_nibbles(bytes);
      const __m256i scale_low = _mm256_shuffle_epi8(scales16, int16_lane(2 * c));
      const __m256i scale_high = _mm256_shuffle_epi8(scales16, int16_lane(2 * c + 1));
      for (int m = 0; m < MT; ++m) {
        const int8_t* xm = x + m * rows.quant_stride + 64 * c;
        sums[m] = _mm256_add_epi32(sums[m], _mm256_add_epi32(dot_scaled(low, xm, scale_low),
                                                             dot_scaled(high, xm + 32, scale_high)));
      }
    }
    for (int m = 0; m < MT; ++m) {
      const float dx = rows.scales[m * rows.scale_stride + b];
      const __m256i x_sums = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(rows.sums + m * rows.sum_stride + b * (kElements / 16)));
      const __m256i min_terms = _mm256_madd_epi16(mins_per16, x_sums);  // m_j * sum(q_x_j), lane j
      acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(sums[m]), acc[m]);
      acc[m] = _mm256_fnmadd_ps(_mm256_set1_ps(dmin * dx), _mm256_cvtepi32_ps(min_terms), acc[m]);
    }
  }
#endif
};

// Q6_K against x quantized per 256: d_w * d_x * sum_g sc_g * (dot(q_g, q_x_g) - 32 * sum(q_x_g)) over the 16
// groups g of 16, all integer (the int8 scales as int16 multipliers; the -32 offset against the per-16 sums of
// the quants), one float conversion per super-block.
struct Q6_KBlock {
  static constexpr int kElements = 256, kBytes = 210;
#ifdef KVFLOW_QUANT_VNNI
  // AVX-512 VNNI: 64 quants at a time, elements 128 h + [0, 64) (low nibbles of ql[64 h, 64 h + 64) with qh's
  // bit pairs 0 and 1) and 128 h + [64, 128) (high nibbles with bit pairs 2 and 3), x's 64 quants there in order:
  // one x load, one maddubs and one vpdpwssd (scales of groups g..g+3, 8 int16 lanes each) per 64 and x row.
  using Acc = __m512;
  template <int MT>
  static void accumulate(const uint8_t* block, const QuantRows& rows, int64_t b, __m512* acc) {
    const float d = fp16_to_float(block + 208);
    const __m128i scales8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));
    const __m512i scales16 = _mm512_cvtepi8_epi16(_mm256_zextsi128_si256(scales8));  // sc_0..sc_15, lanes 0-15
    // The -32 offset first: -32 sc_g times sum(q_x_g), lanes 0-7 (|32 sc_g| <= 4096 fits int16).
    const __m512i offset_scales = _mm512_sub_epi16(_mm512_setzero_si512(), _mm512_slli_epi16(scales16, 5));
    __m512i sums[MT];
    for (int m = 0; m < MT; ++m) {
      const __m512i x_sums = _mm512_zextsi256_si512(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(rows.sums + m * rows.sum_stride + b * (kElements / 16))));
      sums[m] = _mm512_dpwssd_epi32(_mm512_setzero_si512(), x_sums, offset_scales);
    }
    const __m512i nibble = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
    // Per 16-bit lane: qh shifted left 4 (low half) / 2 (high half) for the first 64, 0 / right 2 for the next.
    const __m512i shift_first = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16(4), _mm512_set1_epi16(2));
    const __m512i shift_second = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_setzero_si512(), _mm512_set1_epi16(2));
    const int8_t* x = rows.quants + b * kElements;
    for (int h = 0; h < 2; ++h) {
      const __m512i low = _mm512_loadu_si512(block + 64 * h);
      const __m512i high =
          _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * h)));
      const __m512i first = _mm512_or_si512(_mm512_and_si512(low, nibble),
                                            _mm512_and_si512(_mm512_sllv_epi16(high, shift_first), bits45));
      const __m512i second = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(low, 4), nibble),
                                             _mm512_and_si512(_mm512_srlv_epi16(high, shift_second), bits45));
      const __m512i group = _mm512_set1_epi16(static_cast<int16_t>(8 * h));
      const __m512i lane_group = _mm512_srli_epi16(
          _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9,
                           8, 7, 6, 5, 4, 3, 2, 1, 0),
          3);  // 16-bit lane i covers quants 2i, 2i + 1: group i / 8 of the 64
      const __m512i scale_first = _mm512_permutexvar_epi16(_mm512_add_epi16(group, lane_group), scales16);
      const __m512i scale_second = _mm512_permutexvar_epi16(
          _mm512_add_epi16(_mm512_add_epi16(group, _mm512_set1_epi16(4)), lane_group), scales16);
      for (int m = 0; m < MT; ++m) {
        const int8_t* xm = x + m * rows.quant_stride + 128 * h;
        sums[m] = _mm512_dpwssd_epi32(sums[m], _mm512_maddubs_epi16(first, _mm512_loadu_si512(xm)), scale_first);
        sums[m] =
            _mm512_dpwssd_epi32(sums[m], _mm512_maddubs_epi16(second, _mm512_loadu_si512(xm + 64)), scale_second);
      }
    }
    for (int m = 0; m < MT; ++m) {
      const __m512 scale = _mm512_set1_ps(d * rows.scales[m * rows.scale_stride + b]);
      acc[m] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sums[m]), acc[m]);
    }
  }
#else
  using Acc = __m256;
  template <int MT>
  static void accumulate(const uint8_t* block, const QuantRows& rows, int64_t b, __m256* acc) {
    const float d = fp16_to_float(block + 208);
    const __m128i scales8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));
    __m256i sums[MT];
    for (int m = 0; m < MT; ++m) sums[m] = _mm256_setzero_si256();
    const __m256i mask = _mm256_set1_epi8(0x30);
    const int8_t* x = rows.quants + b * kElements;
    for (int h = 0; h < 2; ++h) {
      const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * h));
      const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * h + 32));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * h));
      const __m256i quants[4] = {
          _mm256_or_si256(low_nibbles(ql0), _mm256_and_si256(_mm256_slli_epi16(qh, 4), mask)),
          _mm256_or_si256(low_nibbles(ql1), _mm256_and_si256(_mm256_slli_epi16(qh, 2), mask)),
          _mm256_or_si256(high_nibbles(ql0), _mm256_and_si256(qh, mask)),
          _mm256_or_si256(high_nibbles(ql1), _mm256_and_si256(_mm256_srli_epi16(qh, 2), mask))};
      for (int p = 0; p < 4; ++p) {  // quants[p]: elements 128 h + 32 p + [0, 32), groups g = 8 h + 2 p, g + 1
        const int g = 8 * h + 2 * p;
        const __m128i pick = _mm_set_epi64x(0x0101010101010101LL * (g + 1), 0x0101010101010101LL * g);
        const __m256i scale = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales8, pick));  // sc_g x 8 | sc_g+1 x 8
        for (int m = 0; m < MT; ++m)
          sums[m] = _mm256_add_epi32(sums[m],
                                     dot_scaled(quants[p], x + m * rows.quant_stride + 128 * h + 32 * p, scale));
      }
    }
    const __m256i scales16 = _mm256_cvtepi8_epi16(scales8);
    for (int m = 0; m < MT; ++m) {
      const __m256i x_sums = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(rows.sums + m * rows.sum_stride + b * (kElements / 16)));
      const __m256i offsets = _mm256_slli_epi32(_mm256_madd_epi16(scales16, x_sums), 5);  // 32 sc_g sum(q_x_g)
      const __m256 scale = _mm256_set1_ps(d * rows.scales[m * rows.scale_stride + b]);
      acc[m] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(_mm256_sub_epi32(sums[m], offsets)), acc[m]);
    }
  }
#endif
};

// Prefetches the cache lines of `bytes` bytes at `start` + kPrefetchBytes (every line: a K-quant block spans
// 3-4 of them, and one prefetch per block left most of each row to the hardware prefetcher).
inline void prefetch_ahead(const void* start, int bytes) {
  for (int line = 0; line < bytes; line += 64)
    _mm_prefetch(static_cast<const char*>(start) + kPrefetchBytes + line, _MM_HINT_T0);
}

// Weight rows [n_begin, n_end) against x rows [m0, m0 + MT), one weight row at a time: one sequential stream
// per thread. Interleaving two rows (two streams a row apart) measured 2-4x slower from DRAM on a Zen 4
// EPYC (Q4_K 3.1 -> 13.6 GB/s, Q6_K 2.9 -> 15.0, Q8_0 6.9 -> 13.3 on one thread, the same kernels 14-16 GB/s on
// weights in L2): the prefetchers followed one stream far better than two.
#ifdef KVFLOW_AVX512
constexpr int64_t kQ8_0TwoRowsMinK = 4096;  // float32 x of 16 KiB and more

// Q8_0 against one x row, two weight rows per pass sharing each x load, each row summed exactly as
// Q8_0Block::accumulate sums it alone (so results equal the one-row pass bit for bit). At K = 8192 the float32 x
// row (32 KiB) no longer stays in L1 beside the weights, and re-reading it for every weight row held the GEMV at
// ~57 % of the read ceiling.
inline void q8_0_two_rows(const uint8_t* row0, const uint8_t* row1, int64_t num_blocks, const float* x, float* out0,
                          float* out1) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* block0 = row0 + b * Q8_0Block::kBytes;
    const uint8_t* block1 = row1 + b * Q8_0Block::kBytes;
    prefetch_ahead(block0, Q8_0Block::kBytes);
    prefetch_ahead(block1, Q8_0Block::kBytes);
    const __m512 x0 = _mm512_loadu_ps(x + b * 32), x1 = _mm512_loadu_ps(x + b * 32 + 16);
    const __m512 d0 = _mm512_set1_ps(fp16_to_float(block0)), d1 = _mm512_set1_ps(fp16_to_float(block1));
    const __m128i* q0 = reinterpret_cast<const __m128i*>(block0 + 2);
    const __m128i* q1 = reinterpret_cast<const __m128i*>(block1 + 2);
    const __m512 w00 = _mm512_mul_ps(d0, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q0))));
    const __m512 w01 = _mm512_mul_ps(d0, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q0 + 1))));
    const __m512 w10 = _mm512_mul_ps(d1, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q1))));
    const __m512 w11 = _mm512_mul_ps(d1, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q1 + 1))));
    acc0 = _mm512_fmadd_ps(x1, w01, _mm512_fmadd_ps(x0, w00, acc0));
    acc1 = _mm512_fmadd_ps(x1, w11, _mm512_fmadd_ps(x0, w10, acc1));
  }
  *out0 = reduce(acc0);
  *out1 = reduce(acc1);
}
#endif

template <class Block, int MT, class Rows>
void ggml_band(const uint8_t* w, int64_t row_bytes, int64_t num_blocks, const Rows& x, int64_t m0, int64_t n_begin,
               int64_t n_end, const float* bias, float* y, int64_t N) {
  const Rows rows = x.at(m0);
#ifdef KVFLOW_AVX512
  if constexpr (std::is_same_v<Block, Q8_0Block> && MT == 1) {
    // Only where x outgrows L1's share: at K = 2048 two weight streams cost the prefetchers more than the shared
    // x loads save (0.58-0.64x measured), at K = 8192 they gain 1.14-1.24x (benchmarks/quant_kernels.py).
    for (; num_blocks * Q8_0Block::kElements >= kQ8_0TwoRowsMinK && n_begin + 2 <= n_end; n_begin += 2) {
      float sum0, sum1;
      q8_0_two_rows(w + n_begin * row_bytes, w + (n_begin + 1) * row_bytes, num_blocks, rows.x, &sum0, &sum1);
      y[m0 * N + n_begin] = sum0 + (bias ? bias[n_begin] : 0.f);
      y[m0 * N + n_begin + 1] = sum1 + (bias ? bias[n_begin + 1] : 0.f);
    }
  }
#endif
  for (int64_t n = n_begin; n < n_end; ++n) {
    typename Block::Acc acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = zero_like(acc[m]);
    const uint8_t* row = w + n * row_bytes;
    for (int64_t b = 0; b < num_blocks; ++b) {
      const uint8_t* block = row + b * Block::kBytes;
      prefetch_ahead(block, Block::kBytes);
      Block::template accumulate<MT>(block, rows, b, acc);
    }
    for (int m = 0; m < MT; ++m) y[(m0 + m) * N + n] = reduce(acc[m]) + (bias ? bias[n] : 0.f);
  }
}

// f(std::integral_constant<int, MT>, m0) over x rows [0, M) in register passes of MT <= 8 rows: the row count is
// a template argument of every pass.
template <class F>
void by_row_passes(int64_t M, F&& f) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) f(std::integral_constant<int, 8>{}, m);
  switch (M - m) {
    case 1: f(std::integral_constant<int, 1>{}, m); break;
    case 2: f(std::integral_constant<int, 2>{}, m); break;
    case 3: f(std::integral_constant<int, 3>{}, m); break;
    case 4: f(std::integral_constant<int, 4>{}, m); break;
    case 5: f(std::integral_constant<int, 5>{}, m); break;
    case 6: f(std::integral_constant<int, 6>{}, m); break;
    case 7: f(std::integral_constant<int, 7>{}, m); break;
    default: break;
  }
}

template <class Block, class Rows>
void ggml_band_any_m(const uint8_t* w, int64_t row_bytes, int64_t num_blocks, const Rows& x, int64_t M,
                     int64_t n_begin, int64_t n_end, const float* bias, float* y, int64_t N) {
  by_row_passes(M, [&](auto rows, int64_t m) {
    ggml_band<Block, decltype(rows)::value>(w, row_bytes, num_blocks, x, m, n_begin, n_end, bias, y, N);
  });
}

// More x rows than one register pass holds (8): blocked so that a weight tile (kGemvTileRows rows, L1/L2) runs
// against every group of 8 rows of an x block (kGemvBlockRows rows, L2) before the next tile streams in, and the
// weights are read from memory once per x block. Up to 8 rows this is the plain one-stream GEMV.
constexpr int64_t kGemvTileRows = 16;
constexpr int64_t kGemvBlockRows = 64;

template <class Block, class Rows>
void ggml_gemv(const Rows& x, int64_t M, int64_t K, const uint8_t* w, int64_t N, const float* bias, float* y,
               int num_threads) {
  const int64_t num_blocks = K / Block::kElements, row_bytes = num_blocks * Block::kBytes;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, N / 2)));
#pragma omp parallel num_threads(threads)
  {
    int64_t begin, end;
    thread_range(N, omp_get_thread_num(), omp_get_num_threads(), begin, end);
    if (M <= 8) {
      ggml_band_any_m<Block>(w, row_bytes, num_blocks, x, M, begin, end, bias, y, N);
    } else {
      for (int64_t m0 = 0; m0 < M; m0 += kGemvBlockRows) {
        const int64_t rows = std::min(kGemvBlockRows, M - m0);
        for (int64_t n = begin; n < end; n += kGemvTileRows)
          ggml_band_any_m<Block>(w, row_bytes, num_blocks, x.at(m0), rows, n, std::min(end, n + kGemvTileRows),
                                 bias, y + m0 * N, N);
      }
    }
  }
}

// int8 rows [n_begin, n_end) against x rows [m0, m0 + MT), one weight row at a time (one stream: see ggml_band),
// scaled once per row.
#ifdef KVFLOW_AVX512
// AVX-512: 16 quants sign-extended to int32 from memory per fused multiply-add; the last K % 16 columns masked.
template <int MT>
void int8_band(const int8_t* w, int64_t K, const float* xf, int64_t xs, const float* scale, int64_t m0,
               int64_t n_begin, int64_t n_end, const float* bias, float* y, int64_t N) {
  const float* x = xf + m0 * xs;
  const __mmask16 tail = tail_mask(K % 16);
  for (int64_t n = n_begin; n < n_end; ++n) {
    const int8_t* row = w + n * K;
    __m512 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(row + k) + kPrefetchBytes, _MM_HINT_T0);
      const __m128i* quants = reinterpret_cast<const __m128i*>(row + k);
      const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(quants)));
      const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(quants + 1)));
      for (int m = 0; m < MT; ++m)
        acc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * xs + k + 16), q1,
                                 _mm512_fmadd_ps(_mm512_loadu_ps(x + m * xs + k), q0, acc[m]));
    }
    for (; k < K; k += 16) {
      const __mmask16 mask = k + 16 <= K ? static_cast<__mmask16>(0xffff) : tail;
      const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, row + k)));
      for (int m = 0; m < MT; ++m) acc[m] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x + m * xs + k), q, acc[m]);
    }
    for (int m = 0; m < MT; ++m)
      y[(m0 + m) * N + n] = _mm512_reduce_add_ps(acc[m]) * scale[n] + (bias ? bias[n] : 0.f);
  }
}
#else
template <int MT>
void int8_band(const int8_t* w, int64_t K, const float* xf, int64_t xs, const float* scale, int64_t m0,
               int64_t n_begin, int64_t n_end, const float* bias, float* y, int64_t N) {
  const float* x = xf + m0 * xs;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const int8_t* row = w + n * K;
    __m256 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(row + k) + kPrefetchBytes, _MM_HINT_T0);
      __m256 q[4];
      widen32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k)), q);
      for (int m = 0; m < MT; ++m) acc[m] = _mm256_add_ps(acc[m], dot32(x + m * xs + k, q));
    }
    for (; k + 8 <= K; k += 8) {
      const __m256 q = widen8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k)));
      for (int m = 0; m < MT; ++m) acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * xs + k), q, acc[m]);
    }
    for (int m = 0; m < MT; ++m) {
      float total = sum8(acc[m]);
      for (int64_t kk = k; kk < K; ++kk) total += x[m * xs + kk] * static_cast<float>(row[kk]);
      y[(m0 + m) * N + n] = total * scale[n] + (bias ? bias[n] : 0.f);
    }
  }
}
#endif

#ifdef KVFLOW_QUANT_VNNI
// ---- int8 weights against x quantized per row (more rows than the GEMV takes; AVX-512 VNNI) ----
//
// W8A8 with a dynamic scale per activation row: x row m becomes q_x = round-half-even(x / d_x), d_x = amax / 127
// (quantize_block over the whole row), and y[m, n] = (sum_k w[n, k] q_x[m, k]) * d_x[m] * scale[n] (+ bias). The
// dot is one exact int32 (|w q_x| <= 127 * 128 per term, K < 2^17), so a row's output does not depend on how many
// rows share the call, nor on the thread count. vpdpbusd takes u8 x s8: x is stored shifted (q_x + 128, the
// ShiftedRowQuantizedX the Q8_0 W8A8 kernel below shares) and 128 * sum(w[n]) is taken back per weight row.
constexpr int kInt8GemmR = 4;   // weight rows per register block
constexpr int kInt8GemmMT = 5;  // x rows per register block: 20 accumulators + 5 x + 1 weight vector
// x quants per block of rows (L2) in every W8A8 kernel: each weight row is read once per block.
constexpr int64_t kW8A8XBlockBytes = 512 * 1024;
// Above this many x rows the Q4_0, Q4_K and Q6_K products (the integer GEMV's family) run on interleaved weight
// tiles (interleaved_product).
constexpr int64_t kInterleavedAboveRows = 8;

// x rows quantized alone, stored shifted (q + 128 as u8), K rounded up to 64 (padded with 128, q = 0: the padding
// multiplies no weight, the kernels load the weights' tail masked).
struct ShiftedRowQuantizedX {
  int64_t padded;
  std::vector<uint8_t> quants;  // [M, padded]
  std::vector<float> scales;    // [M] d_x

  ShiftedRowQuantizedX(const float* xf, int64_t M, int64_t K, int64_t xs)
      : padded((K + 63) / 64 * 64), quants(static_cast<size_t>(M * padded), 128), scales(static_cast<size_t>(M)) {
    std::vector<int8_t> row(static_cast<size_t>(K));
    for (int64_t m = 0; m < M; ++m) {
      scales[m] = quantize_block(xf + m * xs, K, row.data());
      for (int64_t k = 0; k < K; ++k) quants[m * padded + k] = static_cast<uint8_t>(row[k] + 128);
    }
  }
};

// out[r][m] = sum_k w[r, k] (q_x[m, k] + 128) for R weight rows (K apart) and MT shifted x rows (`padded` apart).
template <int R, int MT>
inline void int8_dots(const int8_t* w, int64_t K, const uint8_t* x, int64_t padded, int32_t out[R][MT]) {
  __m512i acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_si512();
  const int64_t full = K / 64 * 64;
  auto step = [&](int64_t k, __mmask64 mask) {
    __m512i xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = _mm512_loadu_si512(x + m * padded + k);
    for (int r = 0; r < R; ++r) {
      const __m512i wv = _mm512_maskz_loadu_epi8(mask, w + r * K + k);  // masked-off weights read as 0: add nothing
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_dpbusd_epi32(acc[r][m], xv[m], wv);
    }
  };
  for (int64_t k = 0; k < full; k += 64) step(k, ~static_cast<__mmask64>(0));
  if (full < K) step(full, (static_cast<__mmask64>(1) << (K - full)) - 1);
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) out[r][m] = _mm512_reduce_add_epi32(acc[r][m]);
}

// Weight rows [n0, n0 + R) against x rows [m0, m0 + MT): the dots, then y.
template <int R, int MT>
void int8_gemm_block(const int8_t* w, int64_t K, const ShiftedRowQuantizedX& x, const int32_t* shifts, int64_t n0,
                     int64_t m0, const float* scale, const float* bias, float* y, int64_t N) {
  int32_t dots[R][MT];
  int8_dots<R, MT>(w + n0 * K, K, x.quants.data() + m0 * x.padded, x.padded, dots);
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) {
      const float total = static_cast<float>(dots[r][m] - shifts[n0 + r]);
      y[(m0 + m) * N + n0 + r] = total * (x.scales[m0 + m] * scale[n0 + r]) + (bias ? bias[n0 + r] : 0.f);
    }
}

// f(std::integral_constant<int, count>) for a count in [1, Max] known only at run time.
template <int Max, class F>
void with_count(int64_t count, F&& f) {
  if constexpr (Max >= 1) {
    if (count == Max)
      f(std::integral_constant<int, Max>{});
    else
      with_count<Max - 1>(count, f);
  }
}

template <int R>
void int8_gemm_rows(const int8_t* w, int64_t K, const ShiftedRowQuantizedX& x, const int32_t* shifts, int64_t n0,
                    int64_t m_begin, int64_t m_end, const float* scale, const float* bias, float* y, int64_t N) {
  int64_t m = m_begin;
  for (; m + kInt8GemmMT <= m_end; m += kInt8GemmMT)
    int8_gemm_block<R, kInt8GemmMT>(w, K, x, shifts, n0, m, scale, bias, y, N);
  with_count<kInt8GemmMT - 1>(m_end - m, [&](auto rows) {
    int8_gemm_block<R, decltype(rows)::value>(w, K, x, shifts, n0, m, scale, bias, y, N);
  });
}

void int8_gemm_vnni(const float* xf, int64_t M, int64_t K, int64_t xs, const int8_t* w, const float* scale, int64_t N,
                    const float* bias, float* y, int num_threads) {
  const ShiftedRowQuantizedX x(xf, M, K, xs);
  std::vector<int32_t> shifts(static_cast<size_t>(N));  // 128 * sum(w[n])
  const int64_t block_rows = std::max<int64_t>(kInt8GemmMT, kW8A8XBlockBytes / x.padded);
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, N / kInt8GemmR)));
#pragma omp parallel num_threads(threads)
  {
    int64_t begin, end;
    thread_range(N, omp_get_thread_num(), omp_get_num_threads(), begin, end);
    for (int64_t n = begin; n < end; ++n) {
      int32_t total = 0;
      for (int64_t k = 0; k < K; ++k) total += w[n * K + k];
      shifts[n] = 128 * total;
    }
    for (int64_t m0 = 0; m0 < M; m0 += block_rows) {
      const int64_t m1 = std::min(M, m0 + block_rows);
      for (int64_t n = begin; n < end; n += kInt8GemmR)
        with_count<kInt8GemmR>(std::min<int64_t>(kInt8GemmR, end - n), [&](auto rows) {
          int8_gemm_rows<decltype(rows)::value>(w, K, x, shifts.data(), n, m0, m1, scale, bias, y, N);
        });
    }
  }
}

// ---- Q8_0 against x quantized per row (prefill-sized M; AVX-512 VNNI) ----
//
// y[m, n] = d_x[m] * sum_b d_b * sum_{i in b} w_i q_x,i, w_i the block's int8 quants (the kernel is templated on
// the block type; Q4_0 left it for the interleaved tiles, which keep its per-32 activation quants):
// per block an exact int32 dot (vpdpbusd on x shifted to u8, q_x + 128, against the s8 quants, two blocks per
// 512-bit vector), converted and scaled by d_b in fp32; the shift comes back as C_n = sum_b d_b * 128 * sum(w in b),
// one per weight row. Each (n, m) sums its blocks in one fixed order: a row's output does not depend on the rows
// beside it or on the thread count.

// A weight type's 32-element blocks as s8 quants: two blocks as one 512-bit vector with their d's (16 lanes each
// half), or one block as 256 bits.
struct Q8_0Quants {
  static constexpr int kBytes = 34;
  static constexpr int kR = 4, kMT = 4;  // weight rows x x rows per register block
  static void pair(const uint8_t* block, __m512i& quants, __m512& d) {
    quants = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2))),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kBytes + 2)), 1);
    d = _mm512_insertf32x8(_mm512_set1_ps(fp16_to_float(block)), _mm256_set1_ps(fp16_to_float(block + kBytes)), 1);
  }
  static __m256i single(const uint8_t* block) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
  }
};

// C_n = sum_b d_b * 128 * sum(w in b) for one weight row, summed in the block order the dots use.
template <class Quants>
float w8a8_shift_term(const uint8_t* row, int64_t num_blocks) {
  const __m512i shift = _mm512_set1_epi8(static_cast<char>(128));
  __m512 acc = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= num_blocks; b += 2) {
    __m512i quants;
    __m512 d;
    Quants::pair(row + b * Quants::kBytes, quants, d);
    acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), shift, quants)), acc);
  }
  if (b < num_blocks) {
    const uint8_t* block = row + b * Quants::kBytes;
    const __m256 dots = _mm256_cvtepi32_ps(
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm512_castsi512_si256(shift), Quants::single(block)));
    acc = _mm512_fmadd_ps(_mm512_zextps256_ps512(_mm256_set1_ps(fp16_to_float(block))), _mm512_zextps256_ps512(dots),
                          acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// Weight rows [n0, n0 + R) against x rows [m0, m0 + MT), then y.
template <class Quants, int R, int MT>
void w8a8_gemm_block(const uint8_t* w, int64_t row_bytes, int64_t num_blocks, const ShiftedRowQuantizedX& x,
                     const float* shift_terms, int64_t n0, int64_t m0, const float* bias, float* y, int64_t N) {
  __m512 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
  const uint8_t* xq = x.quants.data() + m0 * x.padded;
  int64_t b = 0;
  for (; b + 2 <= num_blocks; b += 2) {
    __m512i xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = _mm512_loadu_si512(xq + m * x.padded + b * 32);
    for (int r = 0; r < R; ++r) {
      __m512i quants;
      __m512 d;
      Quants::pair(w + (n0 + r) * row_bytes + b * Quants::kBytes, quants, d);
      for (int m = 0; m < MT; ++m)
        acc[r][m] = _mm512_fmadd_ps(
            d, _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), xv[m], quants)), acc[r][m]);
    }
  }
  if (b < num_blocks) {  // an odd last block: 256 bits, the upper lanes add zero
    for (int r = 0; r < R; ++r) {
      const uint8_t* block = w + (n0 + r) * row_bytes + b * Quants::kBytes;
      const __m256i quants = Quants::single(block);
      const __m512 d = _mm512_zextps256_ps512(_mm256_set1_ps(fp16_to_float(block)));
      for (int m = 0; m < MT; ++m) {
        const __m256i xm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * x.padded + b * 32));
        const __m256 dots = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), xm, quants));
        acc[r][m] = _mm512_fmadd_ps(d, _mm512_zextps256_ps512(dots), acc[r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) {
      const float total = _mm512_reduce_add_ps(acc[r][m]) - shift_terms[n0 + r];
      y[(m0 + m) * N + n0 + r] = total * x.scales[m0 + m] + (bias ? bias[n0 + r] : 0.f);
    }
}

template <class Quants, int R>
void w8a8_gemm_rows(const uint8_t* w, int64_t row_bytes, int64_t num_blocks, const ShiftedRowQuantizedX& x,
                    const float* shift_terms, int64_t n0, int64_t m_begin, int64_t m_end, const float* bias, float* y,
                    int64_t N) {
  int64_t m = m_begin;
  for (; m + Quants::kMT <= m_end; m += Quants::kMT)
    w8a8_gemm_block<Quants, R, Quants::kMT>(w, row_bytes, num_blocks, x, shift_terms, n0, m, bias, y, N);
  with_count<Quants::kMT - 1>(m_end - m, [&](auto rows) {
    w8a8_gemm_block<Quants, R, decltype(rows)::value>(w, row_bytes, num_blocks, x, shift_terms, n0, m, bias, y, N);
  });
}

template <class Quants>
void w8a8_gemm_vnni(const float* xf, int64_t M, int64_t K, int64_t xs, const uint8_t* w, int64_t N,
                    const float* bias, float* y, int num_threads) {
  const ShiftedRowQuantizedX x(xf, M, K, xs);
  const int64_t num_blocks = K / 32, row_bytes = num_blocks * Quants::kBytes;
  std::vector<float> shift_terms(static_cast<size_t>(N));
  const int64_t block_rows = std::max<int64_t>(Quants::kMT, kW8A8XBlockBytes / x.padded);
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, N / Quants::kR)));
#pragma omp parallel num_threads(threads)
  {
    int64_t begin, end;
    thread_range(N, omp_get_thread_num(), omp_get_num_threads(), begin, end);
    for (int64_t n = begin; n < end; ++n) shift_terms[n] = w8a8_shift_term<Quants>(w + n * row_bytes, num_blocks);
    for (int64_t m0 = 0; m0 < M; m0 += block_rows) {
      const int64_t m1 = std::min(M, m0 + block_rows);
      for (int64_t n = begin; n < end; n += Quants::kR)
        with_count<Quants::kR>(std::min<int64_t>(Quants::kR, end - n), [&](auto rows) {
          w8a8_gemm_rows<Quants, decltype(rows)::value>(w, row_bytes, num_blocks, x, shift_terms.data(), n, m0, m1,
                                                        bias, y, N);
        });
    }
  }
}
// ---- Q4_0 and the K-quants on interleaved 16-row tiles (more rows than kInterleavedAboveRows; AVX-512 VNNI) ----
//
// The GEMV's lanes run along k: every 64 quants cost a maddubs and a vpdpwssd (the sub-block scales as int16
// multipliers) per x row. Here each thread repacks 16 weight rows at a time (per call, into a buffer of 5 KiB per
// K-quant block, 576 bytes per Q4_0 one, that stays in L2) so that lanes are rows: for each group of 4 columns
// one vector holds those 4 quants (u8: Q4_0 / Q4_K 0-15, Q6_K 0-63) of all 16 rows, and one vpdpbusd against x's
// 4 quants broadcast adds 64 products. The scales then apply once per sub-block (32 columns for Q4_0 and Q4_K, 16
// for Q6_K) as a float multiply-add with d * sc per lane, d_x once per block; Q4_K's min term is one multiply-add
// per sub-block, Q6_K's -32 offset (Q4_0's -8) starts each sub-block's int32 dot at -32 sum(q_x) (-8 sum(q_x)).
// The repacking (a 16 x 8 or 16 x 4 dword transpose per 32 or 16 bytes of quants) costs about what 10 x rows do
// and is done once per tile and call; every x row then runs against the tile in passes of kLaneMT. Each output is
// summed by one thread in a fixed order, each x row alone: a row's output depends neither on the thread count nor
// on the rows beside it (above the threshold; the GEMV below it adds the same integers in another order). Against
// the GEMV (benchmarks/quant_kernels.py --baseline, 2 threads, 2-core Intel Xeon with AVX-512 VNNI,
// K=2048,N=8192 / K=8192,N=2048): Q4_K 1.6 / 1.8x at M = 9, 2.2 / 2.0x at M = 64, 2.3 / 1.5x at M = 512 (180-330
// G multiply-adds/s); Q6_K 1.1 / 1.35x, 1.85 / 1.65x, 1.85 / 1.65x; Q4_0 4.0 / 3.7x, 6.0 / 5.3x, 6.0 / 5.1x
// (260-320 G/s; its GEMV converts to float per 32). Up to 8 rows the GEMV stays: there the repacking is not
// always paid back (Q6_K 0.55-0.75x at M = 2-4, Q4_K 0.85-0.9x at 2).
constexpr int kLaneRows = 16;  // weight rows per interleaved tile: one per int32 lane
constexpr int kLaneMT = 8;     // x rows per pass: 8 int32 dots, 8 block sums and 8 accumulators in registers

// out[g] lane r = dword g of rows[r] (16 rows of 8 dwords).
inline void transpose_16x8_dwords(const __m256i rows[16], __m512i out[8]) {
  __m512i z[8], t[8], u[8];
  // z[p]: row p in its low half, row p + 8 in its high half; then an 8 x 8 transpose within each half.
  for (int p = 0; p < 8; ++p) z[p] = _mm512_inserti64x4(_mm512_castsi256_si512(rows[p]), rows[p + 8], 1);
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // u[4 h + g], 128-bit lanes: rows 4h..4h+3 at dword g | at g + 4 | rows + 8 ...
    u[4 * h + 0] = _mm512_unpacklo_epi64(t[4 * h + 0], t[4 * h + 2]);
    u[4 * h + 1] = _mm512_unpackhi_epi64(t[4 * h + 0], t[4 * h + 2]);
    u[4 * h + 2] = _mm512_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
    u[4 * h + 3] = _mm512_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
  }
  const __m512i low = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0), high = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
  for (int g = 0; g < 4; ++g) {
    out[g] = _mm512_permutex2var_epi64(u[g], low, u[g + 4]);
    out[g + 4] = _mm512_permutex2var_epi64(u[g], high, u[g + 4]);
  }
}

// x's 4 quants at `quants` broadcast to every lane.
inline __m512i broadcast4(const int8_t* quants) {
  int32_t word;
  std::memcpy(&word, quants, 4);
  return _mm512_set1_epi32(word);
}

// One block of a tile's weight rows: row r's block at `first` + r * row_bytes for r < count; the lanes past
// `count` (a partial last tile) read as zeros.
struct TileRows {
  const uint8_t* first;
  int64_t row_bytes;
  int count;

  const uint8_t* row(int r) const { return r < count ? first + r * row_bytes : nullptr; }
  // Lane r: the 4 bytes at `offset` of row r's block.
  __m512i gather(int64_t offset) const {
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i offsets = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(static_cast<int32_t>(row_bytes)));
    return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), tail_mask(count), offsets, first + offset, 1);
  }
  // Row r's 32 bytes at `offset`.
  __m256i load32(int r, int64_t offset) const {
    return r < count ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row(r) + offset)) : _mm256_setzero_si256();
  }
};

// The fp16 values in the low (high = false) or high 16 bits of each lane, as fp32 (exact).
inline __m512 fp16_lanes(__m512i words, bool high) {
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(high ? _mm512_srli_epi32(words, 16) : words));
}

// Each lane's dword shifted right by `shift`, then masked.
inline __m512i lane_bits(__m512i words, int shift, int mask) {
  return _mm512_and_si512(_mm512_srli_epi32(words, static_cast<unsigned>(shift)), _mm512_set1_epi32(mask));
}

struct Q4_KTile {
  static constexpr int kElements = 256, kBytes = 144;
  __m512i quants[8][8];  // [sub-block j][group g]: lane r = quants 32 j + 4 g .. 32 j + 4 g + 3 of row r
  __m512 scales[8];      // lane r: d * sc_j of row r
  __m512 mins[8];        // lane r: dmin * m_j of row r

  void repack(const TileRows& rows) {
    // The 16 bytes before the quants, lanes = rows: d and dmin, then the 12 packed 6-bit scales and mins
    // (q4_k_scales_and_mins: j < 4 from bytes j and j + 4, j >= 4 from byte j + 4's nibbles and the top 2 bits
    // of bytes j - 4 and j).
    const __m512i head = rows.gather(0);
    const __m512i low = rows.gather(4), mid = rows.gather(8), high = rows.gather(12);
    const __m512 d = fp16_lanes(head, false), dmin = fp16_lanes(head, true);
    for (int j = 0; j < 4; ++j) {
      const __m512i sc =
          _mm512_or_si512(lane_bits(high, 8 * j, 15), _mm512_slli_epi32(lane_bits(low, 8 * j + 6, 3), 4));
      const __m512i mn =
          _mm512_or_si512(lane_bits(high, 8 * j + 4, 15), _mm512_slli_epi32(lane_bits(mid, 8 * j + 6, 3), 4));
      scales[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(lane_bits(low, 8 * j, 63)));
      mins[j] = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(lane_bits(mid, 8 * j, 63)));
      scales[j + 4] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
      mins[j + 4] = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mn));
    }
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {  // 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high ones
      __m256i packed[kLaneRows];
      for (int r = 0; r < kLaneRows; ++r) packed[r] = rows.load32(r, 16 + 32 * c);
      __m512i groups[8];
      transpose_16x8_dwords(packed, groups);
      for (int g = 0; g < 8; ++g) {
        quants[2 * c][g] = _mm512_and_si512(groups[g], nibble);
        quants[2 * c + 1][g] = _mm512_and_si512(_mm512_srli_epi16(groups[g], 4), nibble);
      }
    }
  }

  // acc[m] += this block (block b of the row) against x row m: d_x sum_j (d sc_j) dot_j - sum_j (dmin m_j) (d_x
  // sum(q_x_j)).
  template <int MT>
  void accumulate(const QuantRows& x, int64_t b, __m512* acc) const {
    __m512 block_sum[MT];
    for (int m = 0; m < MT; ++m) block_sum[m] = _mm512_setzero_ps();
    for (int j = 0; j < 8; ++j) {
      __m512i dots[MT];
      for (int m = 0; m < MT; ++m) dots[m] = _mm512_setzero_si512();
      for (int g = 0; g < 8; ++g)
        for (int m = 0; m < MT; ++m)
          dots[m] = _mm512_dpbusd_epi32(dots[m], quants[j][g],
                                        broadcast4(x.quants + m * x.quant_stride + b * 256 + 32 * j + 4 * g));
      for (int m = 0; m < MT; ++m) {
        block_sum[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[m]), scales[j], block_sum[m]);
        acc[m] = _mm512_fnmadd_ps(mins[j], _mm512_set1_ps(x.scaled_sums[m * (x.sum_stride / 2) + b * 8 + j]), acc[m]);
      }
    }
    for (int m = 0; m < MT; ++m)
      acc[m] = _mm512_fmadd_ps(block_sum[m], _mm512_set1_ps(x.scales[m * x.scale_stride + b]), acc[m]);
  }
};

struct Q6_KTile {
  static constexpr int kElements = 256, kBytes = 210;
  __m512i quants[16][4];  // [group G of 16][i]: lane r = quants 16 G + 4 i .. 16 G + 4 i + 3 of row r (0-63)
  __m512 scales[16];      // lane r: d * sc_G of row r

  void repack(const TileRows& rows) {
    // The 16 int8 scales (bytes 192-207) and d (208-209), lanes = rows; d read as the top half of bytes 206-209
    // (a dword at 208 would read past the block).
    const __m512 d = fp16_lanes(rows.gather(206), true);
    for (int q = 0; q < 4; ++q) {
      const __m512i words = rows.gather(192 + 4 * q);
      for (int i = 0; i < 4; ++i) {  // byte i, sign-extended: shifted to the top, then arithmetically down
        const __m512i sc = _mm512_srai_epi32(_mm512_slli_epi32(words, static_cast<unsigned>(24 - 8 * i)), 24);
        scales[4 * q + i] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
      }
    }
    const __m256i bits45 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
      __m256i packed[4][kLaneRows];  // [p][r]: quants 128 h + 32 p + [0, 32) of row r, as in Q6_KBlock
      for (int r = 0; r < kLaneRows; ++r) {
        const __m256i ql0 = rows.load32(r, 64 * h), ql1 = rows.load32(r, 64 * h + 32);
        const __m256i qh = rows.load32(r, 128 + 32 * h);
        packed[0][r] = _mm256_or_si256(low_nibbles(ql0), _mm256_and_si256(_mm256_slli_epi16(qh, 4), bits45));
        packed[1][r] = _mm256_or_si256(low_nibbles(ql1), _mm256_and_si256(_mm256_slli_epi16(qh, 2), bits45));
        packed[2][r] = _mm256_or_si256(high_nibbles(ql0), _mm256_and_si256(qh, bits45));
        packed[3][r] = _mm256_or_si256(high_nibbles(ql1), _mm256_and_si256(_mm256_srli_epi16(qh, 2), bits45));
      }
      for (int p = 0; p < 4; ++p) {
        __m512i groups[8];
        transpose_16x8_dwords(packed[p], groups);
        for (int g = 0; g < 8; ++g) quants[8 * h + 2 * p + g / 4][g % 4] = groups[g];
      }
    }
  }

  // acc[m] += d_x sum_G (d sc_G) (dot_G - 32 sum(q_x_G)) for this block against x row m.
  template <int MT>
  void accumulate(const QuantRows& x, int64_t b, __m512* acc) const {
    __m512 block_sum[MT];
    for (int m = 0; m < MT; ++m) block_sum[m] = _mm512_setzero_ps();
    for (int g = 0; g < 16; ++g) {
      __m512i dots[MT];
      for (int m = 0; m < MT; ++m) dots[m] = _mm512_set1_epi32(-32 * x.sums[m * x.sum_stride + b * 16 + g]);
      for (int i = 0; i < 4; ++i)
        for (int m = 0; m < MT; ++m)
          dots[m] = _mm512_dpbusd_epi32(dots[m], quants[g][i],
                                        broadcast4(x.quants + m * x.quant_stride + b * 256 + 16 * g + 4 * i));
      for (int m = 0; m < MT; ++m)
        block_sum[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[m]), scales[g], block_sum[m]);
    }
    for (int m = 0; m < MT; ++m)
      acc[m] = _mm512_fmadd_ps(block_sum[m], _mm512_set1_ps(x.scales[m * x.scale_stride + b]), acc[m]);
  }
};

// out[g] lane r = dword g of rows[r] (16 rows of 4 dwords).
inline void transpose_16x4_dwords(const __m128i rows[16], __m512i out[4]) {
  __m512i z[4], t[4];
  // z[p]: rows p, p + 4, p + 8, p + 12 in its four 128-bit lanes; then a 4 x 4 transpose within each lane.
  for (int p = 0; p < 4; ++p) {
    const __m256i low = _mm256_inserti128_si256(_mm256_castsi128_si256(rows[p]), rows[p + 4], 1);
    const __m256i high = _mm256_inserti128_si256(_mm256_castsi128_si256(rows[p + 8]), rows[p + 12], 1);
    z[p] = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
  }
  t[0] = _mm512_unpacklo_epi32(z[0], z[1]);
  t[1] = _mm512_unpackhi_epi32(z[0], z[1]);
  t[2] = _mm512_unpacklo_epi32(z[2], z[3]);
  t[3] = _mm512_unpackhi_epi32(z[2], z[3]);
  out[0] = _mm512_unpacklo_epi64(t[0], t[2]);
  out[1] = _mm512_unpackhi_epi64(t[0], t[2]);
  out[2] = _mm512_unpacklo_epi64(t[1], t[3]);
  out[3] = _mm512_unpackhi_epi64(t[1], t[3]);
}

struct Q4_0Tile {
  static constexpr int kElements = 32, kBytes = 18;
  __m512i quants[8];  // [group g]: lane r = quants 4 g .. 4 g + 3 of row r (u8 0-15; the -8 is x's side)
  __m512 scales;      // lane r: d of row r

  void repack(const TileRows& rows) {
    scales = fp16_lanes(rows.gather(0), false);
    __m128i packed[kLaneRows];  // elements 0-15 in the low nibbles, 16-31 in the high ones
    for (int r = 0; r < kLaneRows; ++r)
      packed[r] = r < rows.count ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows.row(r) + 2))
                                 : _mm_setzero_si128();
    __m512i groups[4];
    transpose_16x4_dwords(packed, groups);
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int g = 0; g < 4; ++g) {
      quants[g] = _mm512_and_si512(groups[g], nibble);
      quants[g + 4] = _mm512_and_si512(_mm512_srli_epi16(groups[g], 4), nibble);
    }
  }

  // acc[m] += d_x (d (dot - 8 sum(q_x))) for this block against x row m (x quantized per 32, as the GEMV's).
  template <int MT>
  void accumulate(const QuantRows& x, int64_t b, __m512* acc) const {
    __m512i dots[MT];
    for (int m = 0; m < MT; ++m) {
      const int16_t* sums = x.sums + m * x.sum_stride + 2 * b;
      dots[m] = _mm512_set1_epi32(-8 * (sums[0] + sums[1]));
    }
    for (int g = 0; g < 8; ++g)
      for (int m = 0; m < MT; ++m)
        dots[m] = _mm512_dpbusd_epi32(dots[m], quants[g], broadcast4(x.quants + m * x.quant_stride + 32 * b + 4 * g));
    for (int m = 0; m < MT; ++m)
      acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dots[m]), scales),
                               _mm512_set1_ps(x.scales[m * x.scale_stride + b]), acc[m]);
  }
};

// A repacked tile (rows [n0, n0 + rows)) against x rows [m0, m0 + MT): y[m, n0 + r] for the first `rows` lanes.
template <class Tile, int MT>
void tile_pass(const Tile* tile, int64_t num_blocks, const QuantRows& x, int64_t m0, int64_t n0, int rows,
               const float* bias, float* y, int64_t N) {
  const QuantRows xr = x.at(m0);
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) tile[b].template accumulate<MT>(xr, b, acc);
  const __mmask16 mask = tail_mask(rows);
  const __m512 bias_lanes = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int m = 0; m < MT; ++m)
    _mm512_mask_storeu_ps(y + (m0 + m) * N + n0, mask, _mm512_add_ps(acc[m], bias_lanes));
}

template <class Tile>
void interleaved_product(const QuantRows& x, int64_t M, int64_t K, const uint8_t* w, int64_t N, const float* bias,
                         float* y, int num_threads) {
  const int64_t num_blocks = K / Tile::kElements, row_bytes = num_blocks * Tile::kBytes;
  const int64_t num_tiles = (N + kLaneRows - 1) / kLaneRows;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, num_tiles)));
#pragma omp parallel num_threads(threads)
  {
    int64_t begin, end;
    thread_range(num_tiles, omp_get_thread_num(), omp_get_num_threads(), begin, end);
    std::vector<Tile> tile(static_cast<size_t>(num_blocks));
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kLaneRows;
      const int rows = static_cast<int>(std::min<int64_t>(kLaneRows, N - n0));
      for (int64_t b = 0; b < num_blocks; ++b)
        tile[b].repack(TileRows{w + n0 * row_bytes + b * Tile::kBytes, row_bytes, rows});
      int64_t m = 0;
      for (; m + kLaneMT <= M; m += kLaneMT)
        tile_pass<Tile, kLaneMT>(tile.data(), num_blocks, x, m, n0, rows, bias, y, N);
      with_count<kLaneMT - 1>(M - m, [&](auto count) {
        tile_pass<Tile, decltype(count)::value>(tile.data(), num_blocks, x, m, n0, rows, bias, y, N);
      });
    }
  }
}

// The interleaved tile of each GEMV block kind.
template <class Block>
struct TileOf;
template <>
struct TileOf<Q4_0Block> {
  using type = Q4_0Tile;
};
template <>
struct TileOf<Q4_KBlock> {
  using type = Q4_KTile;
};
template <>
struct TileOf<Q6_KBlock> {
  using type = Q6_KTile;
};
#endif  // KVFLOW_QUANT_VNNI

// The integer product of M x rows: the GEMV, or above kInterleavedAboveRows the interleaved tiles (VNNI builds).
template <class Block>
void integer_product(const QuantRows& rows, int64_t M, int64_t K, const uint8_t* w, int64_t N, const float* bias,
                     float* y, int num_threads) {
#ifdef KVFLOW_QUANT_VNNI
  if (M > kInterleavedAboveRows) {
    interleaved_product<typename TileOf<Block>::type>(rows, M, K, w, N, bias, y, num_threads);
    return;
  }
#endif
  ggml_gemv<Block>(rows, M, K, w, N, bias, y, num_threads);
}

void int8_gemv(const float* xf, int64_t M, int64_t K, int64_t xs, const int8_t* w, const float* scale, int64_t N,
               const float* bias, float* y, int num_threads) {
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, N / 2)));
#pragma omp parallel num_threads(threads)
  {
    int64_t begin, end;
    thread_range(N, omp_get_thread_num(), omp_get_num_threads(), begin, end);
    by_row_passes(M, [&](auto rows, int64_t m) {
      int8_band<decltype(rows)::value>(w, K, xf, xs, scale, m, begin, end, bias, y, N);
    });
  }
}
#endif  // KVFLOW_QUANT_SIMD

// ---- tiled product: dequantized weight tiles in cache, every x row against them ----

constexpr int64_t kTileRows = 16;   // weight rows per tile (a multiple of kTileR)
constexpr int64_t kTileK = 512;     // columns per tile (a multiple of 256: whole blocks of every type)
constexpr int kTileR = 4;           // weight rows per register block
constexpr int kTileMT = 3;          // x rows per register block: 4 x 3 accumulators + 3 x + 1 weight vectors

// partial[r * M + m] += dot(w[r, 0:width8], x[m, 0:width8]) for r < R, m < MT (width8 a multiple of 8).
template <int R, int MT>
void tile_block(const float* w, const float* x, int64_t xs, int64_t width8, float* partial, int64_t M) {
#ifdef KVFLOW_QUANT_SIMD
  __m256 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < width8; k += 8) {
    __m256 xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = _mm256_loadu_ps(x + m * xs + k);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = _mm256_loadu_ps(w + r * kTileK + k);
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_fmadd_ps(wv, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) partial[r * M + m] += sum8(acc[r][m]);
#else
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) {
      float lanes[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int64_t k = 0; k < width8; k += 8)
        for (int lane = 0; lane < 8; ++lane) lanes[lane] += w[r * kTileK + k + lane] * x[m * xs + k + lane];
      float total = 0.f;
      for (int lane = 0; lane < 8; ++lane) total += lanes[lane];
      partial[r * M + m] += total;
    }
#endif
}

// Every weight row of a tile (rows kTileK floats apart) against x rows [0, MT).
template <int MT>
void tile_rows(const float* tile, int64_t rows, const float* x, int64_t xs, int64_t width8, float* partial,
               int64_t M) {
  int64_t r = 0;
  for (; r + kTileR <= rows; r += kTileR)
    tile_block<kTileR, MT>(tile + r * kTileK, x, xs, width8, partial + r * M, M);
  for (; r < rows; ++r) tile_block<1, MT>(tile + r * kTileK, x, xs, width8, partial + r * M, M);
}

// decode(n, k0, width, out) writes columns [k0, k0 + width) of weight row n as fp32; row_scale (or nullptr)
// multiplies each output row's dot products.
template <class Decode>
void tiled_product(const Decode& decode, const float* xf, int64_t M, int64_t K, int64_t xs, int64_t N,
                   const float* row_scale, const float* bias, float* y, int num_threads) {
  const int64_t num_tiles = (N + kTileRows - 1) / kTileRows;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, num_tiles)));
#pragma omp parallel num_threads(threads)
  {
    int64_t begin, end;
    thread_range(num_tiles, omp_get_thread_num(), omp_get_num_threads(), begin, end);
    std::vector<float> tile(static_cast<size_t>(kTileRows * kTileK));
    std::vector<float> partial(static_cast<size_t>(kTileRows * M));
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kTileRows, rows = std::min(kTileRows, N - n0);
      std::fill(partial.begin(), partial.end(), 0.f);
      for (int64_t k0 = 0; k0 < K; k0 += kTileK) {
        const int64_t width = std::min(kTileK, K - k0), width8 = padded8(width);
        for (int64_t r = 0; r < rows; ++r) {
          float* row = tile.data() + r * kTileK;
          decode(n0 + r, k0, width, row);
          std::fill(row + width, row + width8, 0.f);
        }
        // x rows outermost: a group of kTileMT x rows stays in L1 while the tile (L1/L2) runs past it.
        const float* x = xf + k0;
        int64_t m = 0;
        for (; m + kTileMT <= M; m += kTileMT)
          tile_rows<kTileMT>(tile.data(), rows, x + m * xs, xs, width8, partial.data() + m, M);
        if (M - m == 2) tile_rows<2>(tile.data(), rows, x + m * xs, xs, width8, partial.data() + m, M);
        if (M - m == 1) tile_rows<1>(tile.data(), rows, x + m * xs, xs, width8, partial.data() + m, M);
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t m = 0; m < M; ++m)
          y[m * N + n0 + r] = partial[r * M + m] * (row_scale ? row_scale[n0 + r] : 1.f) +
                              (bias ? bias[n0 + r] : 0.f);
    }
  }
}

struct GgmlDecode {
  const uint8_t* w;
  int64_t row_bytes, block_elements, block_bytes;
  DequantizeBlock dequantize;
  void operator()(int64_t n, int64_t k0, int64_t width, float* out) const {
    const uint8_t* block = w + n * row_bytes + k0 / block_elements * block_bytes;
    for (int64_t b = 0; b < width / block_elements; ++b)
      dequantize(block + b * block_bytes, out + b * block_elements);
  }
};

struct Int8Decode {
  const int8_t* w;
  int64_t K;
  void operator()(int64_t n, int64_t k0, int64_t width, float* out) const {
    const int8_t* row = w + n * K + k0;
    for (int64_t k = 0; k < width; ++k) out[k] = static_cast<float>(row[k]);
  }
};

#ifndef KVFLOW_QUANT_SIMD
// Portable GEMV: each block dequantized to a stack buffer, then dotted with every x row.
void ggml_gemv_portable(const float* xf, int64_t M, int64_t K, int64_t xs, const uint8_t* w, int64_t N, int type,
                        const float* bias, float* y, int num_threads) {
  const int64_t elements = ggml_block_elements(type), bytes = ggml_block_bytes(type);
  const int64_t num_blocks = K / elements, row_bytes = num_blocks * bytes;
  const DequantizeBlock dequantize = block_dequantizer(type);
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    float block[kQK];
    for (int64_t m = 0; m < M; ++m) y[m * N + n] = 0.f;
    for (int64_t b = 0; b < num_blocks; ++b) {
      dequantize(w + n * row_bytes + b * bytes, block);
      for (int64_t m = 0; m < M; ++m) {
        float total = 0.f;
        for (int64_t i = 0; i < elements; ++i) total += block[i] * xf[m * xs + b * elements + i];
        y[m * N + n] += total;
      }
    }
    for (int64_t m = 0; m < M; ++m) y[m * N + n] += bias ? bias[n] : 0.f;
  }
}
#endif

}  // namespace

int64_t ggml_block_elements(int type) { return type == kGgmlQ4_K || type == kGgmlQ6_K ? kQK : 32; }

int64_t ggml_block_bytes(int type) {
  switch (type) {
    case kGgmlQ8_0: return 34;
    case kGgmlQ4_0: return 18;
    case kGgmlQ4_K: return 144;
    default: return 210;
  }
}

void ggml_dequantize(const uint8_t* blocks, int64_t rows, int64_t row_bytes, int type, float* out,
                     int num_threads) {
  const int64_t elements = ggml_block_elements(type), bytes = ggml_block_bytes(type);
  const int64_t num_blocks = row_bytes / bytes, columns = num_blocks * elements;
  const DequantizeBlock dequantize = block_dequantizer(type);
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, rows)));
#pragma omp parallel num_threads(threads)
  {
    int64_t begin, end;
    thread_range(rows, omp_get_thread_num(), omp_get_num_threads(), begin, end);
    for (int64_t n = begin; n < end; ++n)
      for (int64_t b = 0; b < num_blocks; ++b)
        dequantize(blocks + n * row_bytes + b * bytes, out + n * columns + b * elements);
  }
}

int64_t ggml_activation_block(int type) { return activation_block(type); }

template <typename T>
void ggml_quantize_activations(const T* x, int64_t M, int64_t K, int64_t x_stride, int type, int8_t* quants,
                               float* scales) {
  const int64_t xs = padded8(K), block = activation_block(type);
  const std::vector<float> xf = widen_rows<T>(x, M, K, x_stride, xs);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < K / block; ++b)
      scales[m * (K / block) + b] = quantize_block(xf.data() + m * xs + b * block, block, quants + m * K + b * block);
}

template <typename T>
void ggml_linear(const T* x, int64_t M, int64_t K, int64_t x_stride, const uint8_t* w, int64_t N, int type,
                 const float* bias, float* y, int64_t gemv_max_rows, int num_threads) {
  const int64_t xs = padded8(K), block = activation_block(type);
  std::vector<float> xf = widen_rows<T>(x, M, K, x_stride, xs);
#ifdef KVFLOW_QUANT_SIMD
  if (M <= gemv_max_rows && block) {
    const QuantizedActivations quantized(xf.data(), M, K, xs, block);
    const QuantRows rows{quantized.quants.data(), quantized.scales.data(), quantized.sums.data(),
                         quantized.scaled_sums.empty() ? nullptr : quantized.scaled_sums.data(), K, K / block, K / 16};
    switch (type) {
      case kGgmlQ4_0: integer_product<Q4_0Block>(rows, M, K, w, N, bias, y, num_threads); break;
      case kGgmlQ4_K: integer_product<Q4_KBlock>(rows, M, K, w, N, bias, y, num_threads); break;
      default: integer_product<Q6_KBlock>(rows, M, K, w, N, bias, y, num_threads); break;
    }
    return;
  }
#endif
  // The fp32 products see the values the integer GEMV computes with: every M gives the same numbers.
  if (block) fake_quantize_rows(xf.data(), M, K, xs, block);
  const int64_t elements = ggml_block_elements(type), bytes = ggml_block_bytes(type);
  if (M > gemv_max_rows) {
    const GgmlDecode decode{w, K / elements * bytes, elements, bytes, block_dequantizer(type)};
    tiled_product(decode, xf.data(), M, K, xs, N, nullptr, bias, y, num_threads);
    return;
  }
#ifdef KVFLOW_QUANT_SIMD
  ggml_gemv<Q8_0Block>(FloatRows{xf.data(), xs}, M, K, w, N, bias, y, num_threads);
#else
  ggml_gemv_portable(xf.data(), M, K, xs, w, N, type, bias, y, num_threads);
#endif
}

namespace {

// int8 weights against x quantized per row (W8A8, as int8_gemm_vnni) on AMX tiles: the same int32 dots (exact in
// either) and the same float epilogue, so the outputs equal int8_gemm_vnni's bit for bit.
void int8_gemm_amx(const float* xf, int64_t M, int64_t K, int64_t xs, const int8_t* w, const float* scale, int64_t N,
                   const float* bias, float* y, bool emulated, int num_threads) {
  std::vector<int8_t> quants(static_cast<size_t>(M * K));
  std::vector<float> x_scales(static_cast<size_t>(M));
  for (int64_t m = 0; m < M; ++m) x_scales[m] = quantize_block(xf + m * xs, K, quants.data() + m * K);
  amx_int8_product(quants.data(), M, K, x_scales.data(), w, scale, N, bias, y, emulated, num_threads);
}

}  // namespace

template <typename T>
void int8_linear_amx(const T* x, int64_t M, int64_t K, int64_t x_stride, const int8_t* w, const float* scale,
                     int64_t N, const float* bias, float* y, bool emulated, int num_threads) {
  const int64_t xs = padded8(K);
  const std::vector<float> xf = widen_rows<T>(x, M, K, x_stride, xs);
  int8_gemm_amx(xf.data(), M, K, xs, w, scale, N, bias, y, emulated, num_threads);
}

template <typename T>
void int8_linear(const T* x, int64_t M, int64_t K, int64_t x_stride, const int8_t* w, const float* scale, int64_t N,
                 const float* bias, float* y, int64_t gemv_max_rows, int num_threads) {
  const int64_t xs = padded8(K);
  const std::vector<float> xf = widen_rows<T>(x, M, K, x_stride, xs);
#ifdef KVFLOW_QUANT_SIMD
  if (M <= gemv_max_rows) {
    int8_gemv(xf.data(), M, K, xs, w, scale, N, bias, y, num_threads);
    return;
  }
#endif
#ifdef KVFLOW_QUANT_VNNI
  if (amx_usable()) {
    int8_gemm_amx(xf.data(), M, K, xs, w, scale, N, bias, y, false, num_threads);
    return;
  }
  int8_gemm_vnni(xf.data(), M, K, xs, w, scale, N, bias, y, num_threads);
#else
  tiled_product(Int8Decode{w, K}, xf.data(), M, K, xs, N, scale, bias, y, num_threads);
#endif
}

template <typename T>
void ggml_linear_w8a8(const T* x, int64_t M, int64_t K, int64_t x_stride, const uint8_t* w, int64_t N, int type,
                      const float* bias, float* y, int num_threads) {
#ifdef KVFLOW_QUANT_VNNI
  const int64_t xs = padded8(K);
  const std::vector<float> xf = widen_rows<T>(x, M, K, x_stride, xs);
  (void)type;  // Q8_0 (the binding checks)
  w8a8_gemm_vnni<Q8_0Quants>(xf.data(), M, K, xs, w, N, bias, y, num_threads);
#else
  (void)x, (void)M, (void)K, (void)x_stride, (void)w, (void)N, (void)type, (void)bias, (void)y, (void)num_threads;
  throw std::runtime_error("ggml_linear_w8a8 needs an AVX-512 VNNI build");
#endif
}

int64_t k_quant_interleaved_above_rows() {
#ifdef KVFLOW_QUANT_VNNI
  return kInterleavedAboveRows;
#else
  return -1;
#endif
}

bool has_w8a8_kernels() {
#ifdef KVFLOW_QUANT_VNNI
  return true;
#else
  return false;
#endif
}

template void ggml_linear_w8a8<float>(const float*, int64_t, int64_t, int64_t, const uint8_t*, int64_t, int,
                                      const float*, float*, int);
template void ggml_linear_w8a8<bf16>(const bf16*, int64_t, int64_t, int64_t, const uint8_t*, int64_t, int,
                                     const float*, float*, int);
template void ggml_linear<float>(const float*, int64_t, int64_t, int64_t, const uint8_t*, int64_t, int, const float*,
                                 float*, int64_t, int);
template void ggml_linear<bf16>(const bf16*, int64_t, int64_t, int64_t, const uint8_t*, int64_t, int, const float*,
                                float*, int64_t, int);
template void ggml_quantize_activations<float>(const float*, int64_t, int64_t, int64_t, int, int8_t*, float*);
template void ggml_quantize_activations<bf16>(const bf16*, int64_t, int64_t, int64_t, int, int8_t*, float*);
template void int8_linear_amx<float>(const float*, int64_t, int64_t, int64_t, const int8_t*, const float*, int64_t,
                                     const float*, float*, bool, int);
template void int8_linear_amx<bf16>(const bf16*, int64_t, int64_t, int64_t, const int8_t*, const float*, int64_t,
                                    const float*, float*, bool, int);
template void int8_linear<float>(const float*, int64_t, int64_t, int64_t, const int8_t*, const float*, int64_t,
                                 const float*, float*, int64_t, int);
template void int8_linear<bf16>(const bf16*, int64_t, int64_t, int64_t, const int8_t*, const float*, int64_t,
                                const float*, float*, int64_t, int);

}  // namespace kvflow
