// Quantized-weight kernels: llama.cpp's GGUF blocks (Q8_0, Q4_0, Q4_K, Q6_K) and weight-only int8 per channel.
//
// * Dequantization (ggml_dequantize): the same float32 operations, in the same order, as gguf.quants.dequantize
//   (and kvflow/kernels/quant.py's dequantize_reference), so the floats are identical; -ffp-contract=off keeps
//   `step * q - offset` from being fused.
// * GEMV (M <= gemv_max_rows activation rows, decode): works on the blocks, never writing dequantized weights.
//   x is widened to fp32 once; per block the quants are widened to fp32 in registers and dotted with each x row,
//   then scaled once per block (or sub-block): Q8_0 d * dot(x, q); Q4_0 d * dot(x, q - 8) (the -8 applied to the
//   bytes); Q4_K d * sc_j * dot(x_j, q_j) - dmin * m_j * sum(x_j), the per-32 sums of x computed once per call and
//   shared by all weight rows; Q6_K d * sc_g * dot(x_g, q_g - 32) per 16 weights; int8 dot(x, q) * scale[n] at
//   the end. Threads split the weight rows into contiguous bands, so each weight byte streams from memory once.
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
#include <vector>

#include "common.h"
#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#define KVFLOW_QUANT_SIMD 1
#include <immintrin.h>
#elif defined(__F16C__)
#include <immintrin.h>
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

// Each block kind accumulates one block of one weight row against MT rows of x (`x` at the block's first
// column, rows `xs` floats apart): acc[m] gathers scaled dot products in 8 lanes, correction[m] (8 lanes) what
// is subtracted at the end. `sums` holds per-32-column sums of x (rows `ss` apart) at the block's first sub-block.
struct Q8_0Block {
  static constexpr int kElements = 32, kBytes = 34, kSums = 0;
  template <int MT>
  static void accumulate(const uint8_t* block, const float* x, int64_t xs, const float*, int64_t, __m256* acc,
                         __m256*) {
    const __m256 d = _mm256_set1_ps(fp16_to_float(block));
    __m256 q[4];
    widen32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2)), q);
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_fmadd_ps(d, dot32(x + m * xs, q), acc[m]);
  }
};

struct Q4_0Block {
  static constexpr int kElements = 32, kBytes = 18, kSums = 0;
  template <int MT>
  static void accumulate(const uint8_t* block, const float* x, int64_t xs, const float*, int64_t, __m256* acc,
                         __m256*) {
    const __m256 d = _mm256_set1_ps(fp16_to_float(block));
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);  // elements 0-15 | 16-31
    const __m256i quants = _mm256_sub_epi8(low_nibbles(both), _mm256_set1_epi8(8));
    __m256 q[4];
    widen32(quants, q);
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_fmadd_ps(d, dot32(x + m * xs, q), acc[m]);
  }
};

struct Q4_KBlock {
  static constexpr int kElements = 256, kBytes = 144, kSums = 8;
  template <int MT>
  static void accumulate(const uint8_t* block, const float* x, int64_t xs, const float* sums, int64_t ss,
                         __m256* acc, __m256* correction) {
    const float d = fp16_to_float(block), dmin = fp16_to_float(block + 2);
    uint8_t scales[8], mins[8];
    q4_k_scales_and_mins(block + 4, scales, mins);
    alignas(32) float steps[8];  // d * scale_j, broadcast per sub-block below
    _mm256_store_ps(steps, _mm256_mul_ps(_mm256_set1_ps(d), widen8(_mm_loadl_epi64(
                                                                 reinterpret_cast<const __m128i*>(scales)))));
    for (int c = 0; c < 4; ++c) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16 + 32 * c));
      __m256 q[4];
      widen32(low_nibbles(packed), q);
      const __m256 step_low = _mm256_broadcast_ss(steps + 2 * c);
      for (int m = 0; m < MT; ++m) acc[m] = _mm256_fmadd_ps(step_low, dot32(x + m * xs + 64 * c, q), acc[m]);
      widen32(high_nibbles(packed), q);
      const __m256 step_high = _mm256_broadcast_ss(steps + 2 * c + 1);
      for (int m = 0; m < MT; ++m)
        acc[m] = _mm256_fmadd_ps(step_high, dot32(x + m * xs + 64 * c + 32, q), acc[m]);
    }
    // The min term: dmin * m_j * sum(x_j) over the 8 sub-blocks, one lane each.
    const __m256 offsets =
        _mm256_mul_ps(_mm256_set1_ps(dmin), widen8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mins))));
    for (int m = 0; m < MT; ++m)
      correction[m] = _mm256_fmadd_ps(offsets, _mm256_loadu_ps(sums + m * ss), correction[m]);
  }
};

struct Q6_KBlock {
  static constexpr int kElements = 256, kBytes = 210, kSums = 0;

  // Groups g, g + 1 (32 quants - 32 as int8) against x.
  template <int MT>
  static void accumulate32(__m256i quants, float step0, float step1, const float* x, int64_t xs, __m256* acc) {
    __m256 q[4];
    widen32(_mm256_sub_epi8(quants, _mm256_set1_epi8(32)), q);
    const __m256 s0 = _mm256_set1_ps(step0), s1 = _mm256_set1_ps(step1);
    for (int m = 0; m < MT; ++m) {
      const float* xm = x + m * xs;
      __m256 t0 = _mm256_mul_ps(_mm256_loadu_ps(xm), q[0]);
      t0 = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 8), q[1], t0);
      __m256 t1 = _mm256_mul_ps(_mm256_loadu_ps(xm + 16), q[2]);
      t1 = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 24), q[3], t1);
      acc[m] = _mm256_fmadd_ps(s1, t1, _mm256_fmadd_ps(s0, t0, acc[m]));
    }
  }

  template <int MT>
  static void accumulate(const uint8_t* block, const float* x, int64_t xs, const float*, int64_t, __m256* acc,
                         __m256*) {
    const float d = fp16_to_float(block + 208);
    const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
    float step[16];
    for (int g = 0; g < 16; ++g) step[g] = d * static_cast<float>(scales[g]);
    const __m256i mask = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
      const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * h));
      const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * h + 32));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * h));
      const __m256i q0 = _mm256_or_si256(low_nibbles(ql0), _mm256_and_si256(_mm256_slli_epi16(qh, 4), mask));
      const __m256i q1 = _mm256_or_si256(low_nibbles(ql1), _mm256_and_si256(_mm256_slli_epi16(qh, 2), mask));
      const __m256i q2 = _mm256_or_si256(high_nibbles(ql0), _mm256_and_si256(qh, mask));
      const __m256i q3 = _mm256_or_si256(high_nibbles(ql1), _mm256_and_si256(_mm256_srli_epi16(qh, 2), mask));
      const float* xh = x + 128 * h;
      const float* s = step + 8 * h;
      accumulate32<MT>(q0, s[0], s[1], xh, xs, acc);
      accumulate32<MT>(q1, s[2], s[3], xh + 32, xs, acc);
      accumulate32<MT>(q2, s[4], s[5], xh + 64, xs, acc);
      accumulate32<MT>(q3, s[6], s[7], xh + 96, xs, acc);
    }
  }
};

// Weight rows [n_begin, n_end) against x rows [m0, m0 + MT), R weight rows at a time (independent FMA chains).
template <class Block, int R, int MT>
void ggml_rows(const uint8_t* w, int64_t row_bytes, int64_t num_blocks, const float* xf, int64_t xs,
               const float* sums, int64_t ss, int64_t m0, int64_t n_begin, int64_t n_end, const float* bias,
               float* y, int64_t N) {
  const float* x = xf + m0 * xs;
  const float* s = sums + m0 * ss;
  for (int64_t n = n_begin; n < n_end; n += R) {
    __m256 acc[R][MT], correction[R][MT];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) acc[r][m] = correction[r][m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < num_blocks; ++b)
      for (int r = 0; r < R; ++r) {
        const uint8_t* block = w + (n + r) * row_bytes + b * Block::kBytes;
        _mm_prefetch(reinterpret_cast<const char*>(block) + kPrefetchBytes, _MM_HINT_T0);
        Block::template accumulate<MT>(block, x + b * Block::kElements, xs, s + b * Block::kSums, ss, acc[r],
                                       correction[r]);
      }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m)
        y[(m0 + m) * N + n + r] = sum8(acc[r][m]) - sum8(correction[r][m]) + (bias ? bias[n + r] : 0.f);
  }
}

template <class Block, int MT>
void ggml_band(const uint8_t* w, int64_t row_bytes, int64_t num_blocks, const float* xf, int64_t xs,
               const float* sums, int64_t ss, int64_t m0, int64_t n_begin, int64_t n_end, const float* bias,
               float* y, int64_t N) {
  constexpr int R = MT <= 4 ? 2 : 1;
  const int64_t paired_end = n_begin + (n_end - n_begin) / R * R;
  ggml_rows<Block, R, MT>(w, row_bytes, num_blocks, xf, xs, sums, ss, m0, n_begin, paired_end, bias, y, N);
  ggml_rows<Block, 1, MT>(w, row_bytes, num_blocks, xf, xs, sums, ss, m0, paired_end, n_end, bias, y, N);
}

template <class Block>
void ggml_band_any_m(const uint8_t* w, int64_t row_bytes, int64_t num_blocks, const float* xf, int64_t xs,
                     const float* sums, int64_t ss, int64_t M, int64_t n_begin, int64_t n_end, const float* bias,
                     float* y, int64_t N) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8)
    ggml_band<Block, 8>(w, row_bytes, num_blocks, xf, xs, sums, ss, m, n_begin, n_end, bias, y, N);
#define KVFLOW_QUANT_CASE(rows) \
  case rows: ggml_band<Block, rows>(w, row_bytes, num_blocks, xf, xs, sums, ss, m, n_begin, n_end, bias, y, N); break;
  switch (M - m) {
    KVFLOW_QUANT_CASE(1)
    KVFLOW_QUANT_CASE(2)
    KVFLOW_QUANT_CASE(3)
    KVFLOW_QUANT_CASE(4)
    KVFLOW_QUANT_CASE(5)
    KVFLOW_QUANT_CASE(6)
    KVFLOW_QUANT_CASE(7)
    default: break;
  }
#undef KVFLOW_QUANT_CASE
}

template <class Block>
void ggml_gemv(const float* xf, int64_t M, int64_t K, int64_t xs, const uint8_t* w, int64_t N,
               const float* bias, float* y, int num_threads) {
  const int64_t num_blocks = K / Block::kElements, row_bytes = num_blocks * Block::kBytes;
  // Per-32-column sums of x, once per call (Q4_K's min term), summed in column order.
  const int64_t ss = Block::kSums ? K / 32 : 0;
  std::vector<float> sums(static_cast<size_t>(std::max<int64_t>(1, M * ss)), 0.f);
  for (int64_t m = 0; m < M && ss; ++m)
    for (int64_t j = 0; j < ss; ++j) {
      float total = 0.f;
      for (int i = 0; i < 32; ++i) total += xf[m * xs + 32 * j + i];
      sums[m * ss + j] = total;
    }
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, N / 2)));
#pragma omp parallel num_threads(threads)
  {
    int64_t begin, end;
    thread_range(N, omp_get_thread_num(), omp_get_num_threads(), begin, end);
    ggml_band_any_m<Block>(w, row_bytes, num_blocks, xf, xs, sums.data(), ss, M, begin, end, bias, y, N);
  }
}

// int8 rows [n_begin, n_end) against x rows [m0, m0 + MT): dot(x, q) per 32 columns, scaled once per row.
template <int R, int MT>
void int8_rows(const int8_t* w, int64_t K, const float* xf, int64_t xs, const float* scale, int64_t m0,
               int64_t n_begin, int64_t n_end, const float* bias, float* y, int64_t N) {
  const float* x = xf + m0 * xs;
  for (int64_t n = n_begin; n < n_end; n += R) {
    __m256 acc[R][MT];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32)
      for (int r = 0; r < R; ++r) {
        const int8_t* row = w + (n + r) * K + k;
        _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
        __m256 q[4];
        widen32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)), q);
        for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_add_ps(acc[r][m], dot32(x + m * xs + k, q));
      }
    for (; k + 8 <= K; k += 8)
      for (int r = 0; r < R; ++r) {
        const __m256 q = widen8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + (n + r) * K + k)));
        for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * xs + k), q, acc[r][m]);
      }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) {
        float total = sum8(acc[r][m]);
        for (int64_t kk = k; kk < K; ++kk) total += x[m * xs + kk] * static_cast<float>(w[(n + r) * K + kk]);
        y[(m0 + m) * N + n + r] = total * scale[n + r] + (bias ? bias[n + r] : 0.f);
      }
  }
}

template <int MT>
void int8_band(const int8_t* w, int64_t K, const float* xf, int64_t xs, const float* scale, int64_t m0,
               int64_t n_begin, int64_t n_end, const float* bias, float* y, int64_t N) {
  constexpr int R = MT <= 4 ? 2 : 1;
  const int64_t paired_end = n_begin + (n_end - n_begin) / R * R;
  int8_rows<R, MT>(w, K, xf, xs, scale, m0, n_begin, paired_end, bias, y, N);
  int8_rows<1, MT>(w, K, xf, xs, scale, m0, paired_end, n_end, bias, y, N);
}

void int8_gemv(const float* xf, int64_t M, int64_t K, int64_t xs, const int8_t* w, const float* scale, int64_t N,
               const float* bias, float* y, int num_threads) {
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, N / 2)));
#pragma omp parallel num_threads(threads)
  {
    int64_t begin, end;
    thread_range(N, omp_get_thread_num(), omp_get_num_threads(), begin, end);
    int64_t m = 0;
    for (; m + 8 <= M; m += 8) int8_band<8>(w, K, xf, xs, scale, m, begin, end, bias, y, N);
#define KVFLOW_QUANT_CASE(rows) \
  case rows: int8_band<rows>(w, K, xf, xs, scale, m, begin, end, bias, y, N); break;
    switch (M - m) {
      KVFLOW_QUANT_CASE(1)
      KVFLOW_QUANT_CASE(2)
      KVFLOW_QUANT_CASE(3)
      KVFLOW_QUANT_CASE(4)
      KVFLOW_QUANT_CASE(5)
      KVFLOW_QUANT_CASE(6)
      KVFLOW_QUANT_CASE(7)
      default: break;
    }
#undef KVFLOW_QUANT_CASE
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

template <typename T>
void ggml_linear(const T* x, int64_t M, int64_t K, int64_t x_stride, const uint8_t* w, int64_t N, int type,
                 const float* bias, float* y, int64_t gemv_max_rows, int num_threads) {
  const int64_t xs = padded8(K);
  const std::vector<float> xf = widen_rows<T>(x, M, K, x_stride, xs);
  const int64_t elements = ggml_block_elements(type), bytes = ggml_block_bytes(type);
  if (M > gemv_max_rows) {
    const GgmlDecode decode{w, K / elements * bytes, elements, bytes, block_dequantizer(type)};
    tiled_product(decode, xf.data(), M, K, xs, N, nullptr, bias, y, num_threads);
    return;
  }
#ifdef KVFLOW_QUANT_SIMD
  switch (type) {
    case kGgmlQ8_0: ggml_gemv<Q8_0Block>(xf.data(), M, K, xs, w, N, bias, y, num_threads); break;
    case kGgmlQ4_0: ggml_gemv<Q4_0Block>(xf.data(), M, K, xs, w, N, bias, y, num_threads); break;
    case kGgmlQ4_K: ggml_gemv<Q4_KBlock>(xf.data(), M, K, xs, w, N, bias, y, num_threads); break;
    default: ggml_gemv<Q6_KBlock>(xf.data(), M, K, xs, w, N, bias, y, num_threads); break;
  }
#else
  ggml_gemv_portable(xf.data(), M, K, xs, w, N, type, bias, y, num_threads);
#endif
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
  tiled_product(Int8Decode{w, K}, xf.data(), M, K, xs, N, scale, bias, y, num_threads);
}

template void ggml_linear<float>(const float*, int64_t, int64_t, int64_t, const uint8_t*, int64_t, int, const float*,
                                 float*, int64_t, int);
template void ggml_linear<bf16>(const bf16*, int64_t, int64_t, int64_t, const uint8_t*, int64_t, int, const float*,
                                float*, int64_t, int);
template void int8_linear<float>(const float*, int64_t, int64_t, int64_t, const int8_t*, const float*, int64_t,
                                 const float*, float*, int64_t, int);
template void int8_linear<bf16>(const bf16*, int64_t, int64_t, int64_t, const int8_t*, const float*, int64_t,
                                const float*, float*, int64_t, int);

}  // namespace kvflow
