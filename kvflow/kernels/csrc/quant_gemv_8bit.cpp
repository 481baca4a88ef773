// The GEMV (quant_gemv.h) for the 8-bit weights: Q8_0 blocks against x quantized per 32 (the default: integer dots,
// Q8_0IntegerBlock) or against fp32 x (KVFLOW_Q8_0_ACTIVATIONS=float32: each block's quants widened in registers
// and times d, the exact dequantized weights, dot(x, d q), 16 lanes at a time on AVX-512 builds); and int8 rows
// with a float32 scale per row against fp32 x, dot(x, q) * scale[n] at the end.
#include "quant_gemv.h"

#ifdef KVFLOW_QUANT_SIMD
namespace kvflow {
namespace quant {
namespace {

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

// Q8_0: each quant times d is the dequantized weight exactly (an 11-bit fp16 significand times 8 bits fits
// fp32's 24), so acc gathers x * w as the dequantized float32 model's product does, in another order.
struct Q8_0Block {
  static constexpr int kElements = 32, kBytes = 34;
  static int prefetch_bytes() { return kPrefetchBytes; }
#ifdef KVFLOW_AVX512
  // Two weight rows per pass from float32 x of 16 KiB and more (two_rows).
  static constexpr int64_t kPairRowsMinK = 4096;
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

  // Q8_0 against one x row, two weight rows per pass sharing each x load, each row summed exactly as accumulate
  // sums it alone (so results equal the one-row pass bit for bit): for K where the float32 x row no longer stays
  // in L1 beside the weights, so that it is not re-read for every weight row.
  static void two_rows(const uint8_t* row0, const uint8_t* row1, int64_t num_blocks, const float* x, float* out0,
                       float* out1) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    const bool non_temporal = weights_prefetch_non_temporal();
    for (int64_t b = 0; b < num_blocks; ++b) {
      const uint8_t* block0 = row0 + b * kBytes;
      const uint8_t* block1 = row1 + b * kBytes;
      prefetch_ahead(block0, kBytes, kPrefetchBytes, non_temporal);
      prefetch_ahead(block1, kBytes, kPrefetchBytes, non_temporal);
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
#else
  static constexpr int64_t kPairRowsMinK = 0;
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

// Q8_0 against x quantized per 32 (the default, quant_activations.cpp): d_w * d_x * sum(q_w * q_x) per block
// (accumulate_signed_block: 256-bit vpdpbusd on VNNI builds, as a Q8_0 block is 32 bytes and Zen 4 splits
// 512-bit operations in two anyway), one float conversion and multiply-add per block and x row.
struct Q8_0IntegerBlock {
  using Acc = __m256;
  static constexpr int kElements = 32, kBytes = 34;
  static constexpr int64_t kPairRowsMinK = 0;  // one weight row per pass
  static int prefetch_bytes() { return kPrefetchBytes; }
  template <int MT>
  static void accumulate(const uint8_t* block, const QuantRows& rows, int64_t b, __m256* acc) {
    const __m256i quants = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
    accumulate_signed_block<MT>(fp16_to_float(block), quants, rows, b, kElements, acc);
  }
};

// int8 rows [n_begin, n_end) against x rows [m0, m0 + MT), one weight row at a time (one stream: see ggml_band),
// scaled once per row.
#ifdef KVFLOW_AVX512
// AVX-512: 16 quants sign-extended to int32 from memory per fused multiply-add; the last K % 16 columns masked.
template <int MT>
void int8_band(const int8_t* w, int64_t K, const float* xf, int64_t xs, const float* scale, int64_t m0,
               int64_t n_begin, int64_t n_end, const float* bias, float* y, int64_t N) {
  const float* x = xf + m0 * xs;
  const bool non_temporal = weights_prefetch_non_temporal();
  const __mmask16 tail = tail_mask(K % 16);
  for (int64_t n = n_begin; n < n_end; ++n) {
    const int8_t* row = w + n * K;
    __m512 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      prefetch_ahead(row + k, 32, kPrefetchBytes, non_temporal);
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
  const bool non_temporal = weights_prefetch_non_temporal();
  for (int64_t n = n_begin; n < n_end; ++n) {
    const int8_t* row = w + n * K;
    __m256 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      prefetch_ahead(row + k, 32, kPrefetchBytes, non_temporal);
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

}  // namespace

void q8_0_gemv(const FloatRows& x, int64_t M, int64_t K, const uint8_t* w, int64_t N, const float* bias, float* y,
               int num_threads) {
  ggml_gemv<Q8_0Block>(x, M, K, w, N, bias, y, num_threads);
}

void q8_0_integer_gemv(const QuantRows& x, int64_t M, int64_t K, const uint8_t* w, int64_t N, const float* bias,
                       float* y, int num_threads) {
  ggml_gemv<Q8_0IntegerBlock>(x, M, K, w, N, bias, y, num_threads);
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

}  // namespace quant
}  // namespace kvflow
#endif  // KVFLOW_QUANT_SIMD
