// What the quantized-weight kernels (quant_*.cpp) share: the build's instruction-set switches, fp16 decoding, the
// activation quantization's types, thread bands, and the internal entry points each file gives the others.
// kernels.h declares the public entry points (quant_linear.cpp dispatches them); nothing here is used elsewhere.
//
// Every output element is computed by one thread in an order that does not depend on the thread count (band and
// tile boundaries only decide which thread, never how a row is summed), so results are identical for any number of
// threads. The SIMD paths need AVX2 + FMA (also used on AVX-512 builds); other builds get portable loops that the
// compiler vectorises.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"
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
namespace quant {

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

// ---- quant_reference.cpp ----

// Decodes one block of a GGUF type into floats, exactly as gguf.quants.dequantize does.
using DequantizeBlock = void (*)(const uint8_t*, float*);
DequantizeBlock block_dequantizer(int type);

// Portable GEMV (builds without AVX2 + FMA): each block dequantized to a stack buffer, then dotted with every x row.
void ggml_gemv_portable(const float* xf, int64_t M, int64_t K, int64_t xs, const uint8_t* w, int64_t N, int type,
                        const float* bias, float* y, int num_threads);

// ---- quant_activations.cpp ----

// x rows as fp32, `stride` floats apart (K rounded up to a multiple of 8, zero padded).
template <typename T>
std::vector<float> widen_rows(const T* x, int64_t M, int64_t K, int64_t x_stride, int64_t stride) {
  std::vector<float> xf(static_cast<size_t>(M * stride), 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xf[m * stride + k] = to_float<T>(x[m * x_stride + k]);
  return xf;
}

inline int64_t padded8(int64_t count) { return (count + 7) / 8 * 8; }

// x[0:count] as int8 quants; returns the scale d = amax / 127 (q = round-half-even(x / d), 0 when d = 0): the
// same float32 operations as quant.py's quantize_activations_reference, so the quants are identical.
float quantize_block(const float* x, int64_t count, int8_t* quants);

// The rows of x (fp32, `xs` floats apart) quantized per `block` columns, with the per-16 sums of the quants
// (Q4_K's min term, Q6_K's -32 offset).
struct QuantizedActivations {
  int64_t K, block;
  std::vector<int8_t> quants;  // [M, K]
  std::vector<float> scales;   // [M, K / block]
  std::vector<int16_t> sums;   // [M, K / 16]; |sum| <= 16 * 127
  // [M, K / 32]: d_x * the sum of each 32 quants (the K-quants' blocks only; Q4_K's min term on VNNI builds).
  std::vector<float> scaled_sums;

  QuantizedActivations(const float* xf, int64_t M, int64_t K_, int64_t xs, int64_t block_);
};

// Replaces x's rows (fp32, `xs` floats apart) by their quantized values q * d: what the integer GEMV computes
// with, for the products that run in fp32.
void fake_quantize_rows(float* xf, int64_t M, int64_t K, int64_t xs, int64_t block);

// ---- threads and register passes ----

// Splits `count` units among up to `num_threads` threads: thread t of nt gets [begin, end).
inline void thread_range(int64_t count, int t, int nt, int64_t& begin, int64_t& end) {
  begin = count * t / nt;
  end = count * (t + 1) / nt;
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

// ---- quant_tiled.cpp: dequantized fp32 weight tiles in cache, every x row against them (any build) ----

// y = x (fp32, `xs` floats apart) times the dequantized GGUF weight (+ bias).
void ggml_tiled_product(const float* xf, int64_t M, int64_t K, int64_t xs, const uint8_t* w, int64_t N, int type,
                        const float* bias, float* y, int num_threads);
// y = (x . q[n]) * scale[n] (+ bias[n]) for int8 weights [N, K].
void int8_tiled_product(const float* xf, int64_t M, int64_t K, int64_t xs, const int8_t* w, const float* scale,
                        int64_t N, const float* bias, float* y, int num_threads);

// ---- quant_w8a8.cpp: int8 weights against x quantized per row on AMX tiles (any build; amx.cpp's product) ----
void int8_gemm_amx(const float* xf, int64_t M, int64_t K, int64_t xs, const int8_t* w, const float* scale, int64_t N,
                   const float* bias, float* y, bool emulated, int num_threads);

#ifdef KVFLOW_QUANT_SIMD
inline float sum8(__m256 values) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(values), _mm256_extractf128_ps(values, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
  return _mm_cvtss_f32(sum);
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

// x rows quantized (QuantizedActivations) for the integer products, from row m0 on.
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

// ---- quant_gemv_8bit.cpp: Q8_0 (against fp32 or quantized x) and int8 weights, on the weights as stored ----
void q8_0_gemv(const FloatRows& x, int64_t M, int64_t K, const uint8_t* w, int64_t N, const float* bias, float* y,
               int num_threads);
void q8_0_integer_gemv(const QuantRows& x, int64_t M, int64_t K, const uint8_t* w, int64_t N, const float* bias,
                       float* y, int num_threads);
void int8_gemv(const float* xf, int64_t M, int64_t K, int64_t xs, const int8_t* w, const float* scale, int64_t N,
               const float* bias, float* y, int num_threads);

// ---- quant_gemv_integer.cpp: Q4_0, Q4_K or Q6_K (`type`) against quantized x, integer dots per block ----
void integer_gemv(int type, const QuantRows& x, int64_t M, int64_t K, const uint8_t* w, int64_t N, const float* bias,
                  float* y, int num_threads);
#endif  // KVFLOW_QUANT_SIMD

#ifdef KVFLOW_QUANT_VNNI
// Above this many x rows the Q4_0, Q4_K and Q6_K products (the integer GEMV's family) run on interleaved weight
// tiles (interleaved_product).
constexpr int64_t kInterleavedAboveRows = 8;

// ---- quant_repack.cpp: Q4_0, Q4_K or Q6_K (`type`) on interleaved 16-row weight tiles repacked in cache ----
void interleaved_product(int type, const QuantRows& x, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                         const float* bias, float* y, int num_threads);

// ---- quant_w8a8.cpp: x quantized per row, exact int32 dots (vpdpbusd) ----
void int8_gemm_vnni(const float* xf, int64_t M, int64_t K, int64_t xs, const int8_t* w, const float* scale, int64_t N,
                    const float* bias, float* y, int num_threads);
void q8_0_gemm_w8a8(const float* xf, int64_t M, int64_t K, int64_t xs, const uint8_t* w, int64_t N,
                    const float* bias, float* y, int num_threads);
#endif  // KVFLOW_QUANT_VNNI

}  // namespace quant
}  // namespace kvflow
