// Small-M GEMM ("GEMV") for decode: bandwidth-bound, each thread streams a contiguous band of weight rows once.
// x is converted to fp32 once (zero-padded to a multiple of 16); each inner step loads 16 weights of R rows,
// widens them to fp32 (bf16: a 16-bit shift) and FMAs them against MT rows of x, so R * MT accumulators are live.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "common.h"
#include "kernels.h"

namespace kvflow {
namespace {

// How far ahead of the loads each weight row is prefetched (the hardware prefetcher alone under-fills DRAM).
constexpr int kPrefetchBytes = 1024;

template <typename T, int R, int MT>
void dot_block(const T* w, int64_t K, const float* xf, int64_t xf_stride, float (*out)[MT]) {
#ifdef KVFLOW_AVX512
  __m512 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = _mm512_loadu_ps(xf + m * xf_stride + k);
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k) + kPrefetchBytes, _MM_HINT_T0);
      __m512 wv = load16(w + r * K + k);
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);
    }
  }
  if (k < K) {
    __mmask16 mask = tail_mask(K - k);
    __m512 xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = _mm512_loadu_ps(xf + m * xf_stride + k);  // zero padded
    for (int r = 0; r < R; ++r) {
      __m512 wv = load16(w + r * K + k, mask);
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) out[r][m] = _mm512_reduce_add_ps(acc[r][m]);
#elif defined(KVFLOW_AVX2)
  // 8 lanes: R * MT accumulators (16 at R = MT = 4, with the x and w vectors a few spill to L1, which costs far
  // less than reading each weight row once per row of x).
  __m256 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = _mm256_loadu_ps(xf + m * xf_stride + k);
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k) + kPrefetchBytes, _MM_HINT_T0);
      __m256 wv = load8(w + r * K + k);
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_fmadd_ps(wv, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) {
      float sum = reduce8(acc[r][m]);
      const T* row = w + r * K;
      const float* xr = xf + m * xf_stride;
      for (int64_t kk = k; kk < K; ++kk) sum += to_float<T>(row[kk]) * xr[kk];
      out[r][m] = sum;
    }
#else
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) {
      float sum = 0.f;
      const T* row = w + r * K;
      const float* xr = xf + m * xf_stride;
#pragma omp simd reduction(+ : sum)
      for (int64_t k = 0; k < K; ++k) sum += to_float<T>(row[k]) * xr[k];
      out[r][m] = sum;
    }
#endif
}

template <typename T, int R, int MT>
void rows_band(const T* w, int64_t K, const float* xf, int64_t xf_stride, int64_t m0, int64_t n_begin,
               int64_t n_end, const T* bias, T* y, float* y_float, int64_t N) {
  float block[R][MT];
  for (int64_t n = n_begin; n < n_end; n += R) {
    dot_block<T, R, MT>(w + n * K, K, xf + m0 * xf_stride, xf_stride, block);
    for (int r = 0; r < R; ++r) {
      float b = bias ? to_float<T>(bias[n + r]) : 0.f;
      for (int m = 0; m < MT; ++m) {
        float value = block[r][m] + b;
        int64_t index = (m0 + m) * N + n + r;
        if (y_float)
          y_float[index] = round_to<T>(value);
        else
          y[index] = from_float<T>(value);
      }
    }
  }
}

template <typename T, int R>
void rows_band_any_m(const T* w, int64_t K, const float* xf, int64_t xf_stride, int64_t M, int64_t n_begin,
                     int64_t n_end, const T* bias, T* y, float* y_float, int64_t N) {
  // Rows of w stay in L1/L2 between the m tiles of one band chunk, so each weight byte comes from DRAM once.
  constexpr int64_t kChunk = 64;
  for (int64_t c = n_begin; c < n_end; c += kChunk) {
    int64_t c_end = std::min(n_end, c + kChunk);
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) rows_band<T, R, 4>(w, K, xf, xf_stride, m, c, c_end, bias, y, y_float, N);
    switch (M - m) {
      case 3: rows_band<T, R, 3>(w, K, xf, xf_stride, m, c, c_end, bias, y, y_float, N); break;
      case 2: rows_band<T, R, 2>(w, K, xf, xf_stride, m, c, c_end, bias, y, y_float, N); break;
      case 1: rows_band<T, R, 1>(w, K, xf, xf_stride, m, c, c_end, bias, y, y_float, N); break;
      default: break;
    }
  }
}

}  // namespace

template <typename T>
void gemv(const T* x, int64_t M, int64_t K, int64_t x_stride, const T* w, int64_t N, const T* bias, T* y,
          float* y_float, int num_threads) {
  const int64_t xf_stride = (K + 15) / 16 * 16;
  std::vector<float> xf(static_cast<size_t>(M * xf_stride), 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xf[m * xf_stride + k] = to_float<T>(x[m * x_stride + k]);
  constexpr int R = 4;
  const int64_t num_blocks = N / R;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, num_blocks)));
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t begin = num_blocks * t / nt * R, end = num_blocks * (t + 1) / nt * R;
    rows_band_any_m<T, R>(w, K, xf.data(), xf_stride, M, begin, end, bias, y, y_float, N);
    if (t == nt - 1 && end < N) rows_band_any_m<T, 1>(w, K, xf.data(), xf_stride, M, end, N, bias, y, y_float, N);
  }
}

template void gemv<float>(const float*, int64_t, int64_t, int64_t, const float*, int64_t, const float*, float*,
                          float*, int);
template void gemv<bf16>(const bf16*, int64_t, int64_t, int64_t, const bf16*, int64_t, const bf16*, bf16*, float*,
                         int);

uint64_t stream_read(const uint8_t* data, int64_t num_bytes, int num_threads) {
  const int64_t lines = num_bytes / 64;
  uint64_t total = 0;
#pragma omp parallel num_threads(num_threads) reduction(^ : total)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t begin = lines * t / nt, end = lines * (t + 1) / nt;
#ifdef KVFLOW_AVX512
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = begin;
    for (; i + 4 <= end; i += 4) {
      const __m512i* p = reinterpret_cast<const __m512i*>(data + i * 64);
      a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(p));
      a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(p + 1));
      a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(p + 2));
      a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(p + 3));
    }
    for (; i < end; ++i) a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(data + i * 64));
    __m512i all = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
    total ^= static_cast<uint64_t>(_mm512_reduce_or_epi64(all));
#else
    const uint64_t* words = reinterpret_cast<const uint64_t*>(data);
    uint64_t acc = 0;
    for (int64_t i = begin * 8; i < end * 8; ++i) acc ^= words[i];
    total ^= acc;
#endif
  }
  return total;
}

}  // namespace kvflow
