// The GEMV on quantized blocks (M <= gemv_max_rows activation rows, decode), shared by the per-type block kinds
// (quant_gemv_8bit.cpp: Q8_0; quant_gemv_integer.cpp: Q4_0, Q4_K, Q6_K). It works on the blocks as stored, never
// writing dequantized weights: threads split the weight rows into contiguous bands, so each weight byte streams
// from memory once, and each band runs one weight row at a time against register passes of up to 8 x rows.
//
// A block kind `Block` provides kElements and kBytes (per block), Acc (its accumulator vector), prefetch_bytes()
// (how far ahead of a block its row is prefetched), and `accumulate<MT>(block, rows, b, acc)`, which adds block b
// of one weight row against MT x rows (`Rows`: FloatRows or QuantRows) into acc[m]. kPairRowsMinK > 0 (Q8_0 on
// AVX-512) also gives `two_rows`: two weight rows per pass against one x row, each summed exactly as accumulate
// sums it alone, taken when K >= kPairRowsMinK.
#pragma once

#include <omp.h>

#include "cpu_features.h"
#include "quant_internal.h"

#ifdef KVFLOW_QUANT_SIMD
namespace kvflow {
namespace quant {

// How far ahead of the current block each weight row is prefetched: kPrefetchBytes, or for the K-quant blocks
// (Q4_K, Q6_K) on AMD CPUs kFarPrefetchBytes (k_quant_prefetch_bytes; benchmarks/RESULTS.md, "Quantized kernels on
// Zen 4").
constexpr int kPrefetchBytes = 1024;
constexpr int kFarPrefetchBytes = 4096;
inline int k_quant_prefetch_bytes() {
  static const int bytes = cpu_is_amd() ? kFarPrefetchBytes : kPrefetchBytes;
  return bytes;
}

// Accumulator vectors: 8 fp32 lanes (AVX2), 16 on AVX-512 builds for the blocks that use them.
inline __m256 zero_like(__m256) { return _mm256_setzero_ps(); }
inline float reduce(__m256 values) { return sum8(values); }
#ifdef KVFLOW_AVX512
inline __m512 zero_like(__m512) { return _mm512_setzero_ps(); }
inline float reduce(__m512 values) { return _mm512_reduce_add_ps(values); }
#endif

// Whether weight rows stream with non-temporal prefetches (PREFETCHNTA) instead of into every cache level (T0):
// on AMD CPUs. A decode step reads every weight once, more bytes than the caches hold, and with T0 each step's
// stream evicted everything else, so the Python and bookkeeping between the products ran on cold caches; NTA
// keeps the stream out of the caches' long-lived lines (benchmarks/RESULTS.md, "Weights streamed with
// non-temporal prefetches on Zen 4"). Intel CPUs keep T0 (measured there with it). Hints only: results are the
// same either way.
inline bool weights_prefetch_non_temporal() {
  static const bool non_temporal = cpu_is_amd();
  return non_temporal;
}

// Prefetches the cache lines of `bytes` bytes at `start` + `distance` (every line: a K-quant block spans 3-4 of
// them, and one prefetch per block left most of each row to the hardware prefetcher), NTA or T0 as
// `non_temporal` says (weights_prefetch_non_temporal, read once per band by the caller).
inline void prefetch_ahead(const void* start, int bytes, int distance, bool non_temporal) {
  const char* ahead = static_cast<const char*>(start) + distance;
  if (non_temporal) {
    for (int line = 0; line < bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_NTA);
  } else {
    for (int line = 0; line < bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
  }
}

// A 32-element block of signed weight quants (|q| <= 128) times d, against x rows quantized per 32 (Q8_0, Q4_0):
// acc[m] += d * d_x[m] * sum(q_w * q_x[m]), the integer dot taken as |q_w| * (q_x with q_w's sign), u8 x s8
// (exact: |q_x| <= 127). VNNI: one 256-bit vpdpbusd; AVX2: maddubs (pairs <= 2 * 128 * 127, no saturation) then
// madd by ones. Both give the same int32, so every build's results agree.
template <int MT>
inline void accumulate_signed_block(float d, __m256i quants, const QuantRows& rows, int64_t b, int elements,
                                    __m256* acc) {
  const __m256i magnitudes = _mm256_abs_epi8(quants);
  for (int m = 0; m < MT; ++m) {
    const __m256i x = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(rows.quants + m * rows.quant_stride + b * elements));
    const __m256i signed_x = _mm256_sign_epi8(x, quants);
#ifdef KVFLOW_QUANT_VNNI
    const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), magnitudes, signed_x);
#else
    const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitudes, signed_x), _mm256_set1_epi16(1));
#endif
    const __m256 scale = _mm256_set1_ps(d * rows.scales[m * rows.scale_stride + b]);
    acc[m] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(dot), acc[m]);
  }
}

// Weight rows [n_begin, n_end) against x rows [m0, m0 + MT), one weight row at a time: one sequential stream
// per thread (the hardware prefetchers follow one stream far better than two rows interleaved).
template <class Block, int MT, class Rows>
void ggml_band(const uint8_t* w, int64_t row_bytes, int64_t num_blocks, const Rows& x, int64_t m0, int64_t n_begin,
               int64_t n_end, const float* bias, float* y, int64_t N) {
  const Rows rows = x.at(m0);
  if constexpr (Block::kPairRowsMinK > 0 && MT == 1) {
    // Only where x outgrows L1's share: below, two weight streams cost the prefetchers more than the shared x
    // loads save.
    for (; num_blocks * Block::kElements >= Block::kPairRowsMinK && n_begin + 2 <= n_end; n_begin += 2) {
      float sum0, sum1;
      Block::two_rows(w + n_begin * row_bytes, w + (n_begin + 1) * row_bytes, num_blocks, rows.x, &sum0, &sum1);
      y[m0 * N + n_begin] = sum0 + (bias ? bias[n_begin] : 0.f);
      y[m0 * N + n_begin + 1] = sum1 + (bias ? bias[n_begin + 1] : 0.f);
    }
  }
  const int distance = Block::prefetch_bytes();
  const bool non_temporal = weights_prefetch_non_temporal();
  for (int64_t n = n_begin; n < n_end; ++n) {
    typename Block::Acc acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = zero_like(acc[m]);
    const uint8_t* row = w + n * row_bytes;
    for (int64_t b = 0; b < num_blocks; ++b) {
      const uint8_t* block = row + b * Block::kBytes;
      prefetch_ahead(block, Block::kBytes, distance, non_temporal);
      Block::template accumulate<MT>(block, rows, b, acc);
    }
    for (int m = 0; m < MT; ++m) y[(m0 + m) * N + n] = reduce(acc[m]) + (bias ? bias[n] : 0.f);
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

}  // namespace quant
}  // namespace kvflow
#endif  // KVFLOW_QUANT_SIMD
