// Shared helpers for kvflow's CPU kernels: bf16 <-> fp32 conversion (scalar and AVX-512) and a vector exp.
// bf16 is stored as uint16_t; every kernel is a template over the element type T in {float, uint16_t (bf16)}.
// Code paths: __AVX512F__ (+ __AVX512BW__/__AVX512VL__ for masked 16-bit loads), AVX2 + FMA (KVFLOW_AVX2: the
// small-M GEMV only) and a portable scalar fallback that the compiler auto-vectorises; the same source builds
// everywhere with -march=native.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVFLOW_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define KVFLOW_AVX2 1
#include <immintrin.h>
#endif

namespace kvflow {

using bf16 = uint16_t;

inline float bf16_to_float(bf16 value) {
  uint32_t bits = static_cast<uint32_t>(value) << 16;
  float result;
  std::memcpy(&result, &bits, sizeof(result));
  return result;
}

// Round to nearest even, as torch rounds; NaN stays a (quiet) NaN.
inline bf16 float_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<bf16>(bits >> 16);
}

template <typename T>
inline float to_float(T value);
template <>
inline float to_float<float>(float value) { return value; }
template <>
inline float to_float<bf16>(bf16 value) { return bf16_to_float(value); }

template <typename T>
inline T from_float(float value);
template <>
inline float from_float<float>(float value) { return value; }
template <>
inline bf16 from_float<bf16>(float value) { return float_to_bf16(value); }

// Rounds a float to T's precision and back (the identity for float): emulates a tensor op's output rounding.
template <typename T>
inline float round_to(float value) { return to_float<T>(from_float<T>(value)); }

#ifdef KVFLOW_AVX2
// 8 elements as fp32 (bf16: widened by a 16-bit shift).
inline __m256 load8(const float* source) { return _mm256_loadu_ps(source); }
inline __m256 load8(const bf16* source) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(source));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline float reduce8(__m256 values) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(values), _mm256_extractf128_ps(values, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
  return _mm_cvtss_f32(sum);
}
#endif

#ifdef KVFLOW_AVX512
// v[c] = column c of the 16 x 16 matrix whose rows were v[0 .. 16).
inline void transpose16x16(__m512 (&v)[16]) {
  __m512 pairs[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: (r0_0, r1_0, r0_1, r1_1) and (r0_2, r1_2, r0_3, r1_3)
    pairs[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    pairs[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // v[4i + c], lane L: column 4L + c of rows 4i .. 4i + 3
    v[4 * i] = _mm512_shuffle_ps(pairs[4 * i], pairs[4 * i + 2], 0x44);
    v[4 * i + 1] = _mm512_shuffle_ps(pairs[4 * i], pairs[4 * i + 2], 0xEE);
    v[4 * i + 2] = _mm512_shuffle_ps(pairs[4 * i + 1], pairs[4 * i + 3], 0x44);
    v[4 * i + 3] = _mm512_shuffle_ps(pairs[4 * i + 1], pairs[4 * i + 3], 0xEE);
  }
  __m512 columns[16];
  for (int c = 0; c < 4; ++c) {
    const __m512 even01 = _mm512_shuffle_f32x4(v[c], v[4 + c], 0x88);   // lanes 0, 2 of rows 0-3 and 4-7
    const __m512 odd01 = _mm512_shuffle_f32x4(v[c], v[4 + c], 0xDD);    // lanes 1, 3
    const __m512 even23 = _mm512_shuffle_f32x4(v[8 + c], v[12 + c], 0x88);
    const __m512 odd23 = _mm512_shuffle_f32x4(v[8 + c], v[12 + c], 0xDD);
    columns[c] = _mm512_shuffle_f32x4(even01, even23, 0x88);
    columns[8 + c] = _mm512_shuffle_f32x4(even01, even23, 0xDD);
    columns[4 + c] = _mm512_shuffle_f32x4(odd01, odd23, 0x88);
    columns[12 + c] = _mm512_shuffle_f32x4(odd01, odd23, 0xDD);
  }
  for (int c = 0; c < 16; ++c) v[c] = columns[c];
}

inline __mmask16 tail_mask(int64_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << count) - 1u);
}

// 16 elements (masked: `count` < 16 loads zeros past the end) as fp32.
inline __m512 load16(const float* source, __mmask16 mask = 0xffff) {
  return _mm512_maskz_loadu_ps(mask, source);
}
inline __m512 load16(const bf16* source, __mmask16 mask = 0xffff) {
  __m256i raw = _mm256_maskz_loadu_epi16(mask, source);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Round to nearest even, NaN quieted (sign and payload kept), denormals kept: torch's conversion bit for bit on every
// CPU. With AVX512_BF16, vcvtneps2bf16 does exactly this in one instruction except that it reads denormal inputs as
// zero, so it takes every vector without a denormal lane (the fpclass test) and the integer form the others.
inline __m256i float16_to_bf16_bits(__m512 values) {
#ifdef __AVX512BF16__
  if (!_mm512_fpclass_ps_mask(values, 0x20)) return (__m256i)_mm512_cvtneps_pbh(values);
#endif
  __m512i bits = _mm512_castps_si512(values);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  __mmask16 is_nan = _mm512_cmp_ps_mask(values, values, _CMP_UNORD_Q);
  rounded = _mm512_mask_or_epi32(rounded, is_nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(rounded);
}

inline void store16(float* target, __m512 values, __mmask16 mask = 0xffff) {
  _mm512_mask_storeu_ps(target, mask, values);
}
inline void store16(bf16* target, __m512 values, __mmask16 mask = 0xffff) {
  _mm256_mask_storeu_epi16(target, mask, float16_to_bf16_bits(values));
}

// Rounds 16 floats to T's precision (identity for float).
template <typename T>
inline __m512 round16(__m512 values);
template <>
inline __m512 round16<float>(__m512 values) { return values; }
template <>
inline __m512 round16<bf16>(__m512 values) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(float16_to_bf16_bits(values)), 16));
}

// exp(x) for 16 floats: Cephes' polynomial on [-ln2/2, ln2/2] and scalef; ~1 ulp; -inf -> 0, large -> inf.
inline __m512 exp16(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  x = _mm512_min_ps(x, _mm512_set1_ps(89.0f));
  __m512 exponent = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(exponent, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(exponent, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 poly = _mm512_set1_ps(1.9875691500E-4f);
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.3981999507E-3f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(8.3334519073E-3f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(4.1665795894E-2f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.6666665459E-1f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(5.0000001201E-1f));
  __m512 r2 = _mm512_mul_ps(r, r);
  poly = _mm512_fmadd_ps(poly, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(poly, exponent);
}
#endif

}  // namespace kvflow
