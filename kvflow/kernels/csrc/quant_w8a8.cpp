// W8A8 products: x quantized per row (quantize_block over the whole row: d_x = amax / 127), exact int32 dots
// against 8-bit weights, scaled in fp32. On AVX-512 VNNI builds int8 weights (int8_linear above gemv_max_rows) and
// Q8_0 blocks (ggml_linear_w8a8) run on vpdpbusd; int8_gemm_amx is the same int8 product on AMX tiles (amx.cpp),
// equal bit for bit.
#include <omp.h>

#include "quant_internal.h"

namespace kvflow {
namespace quant {

// int8 weights against x quantized per row (W8A8, as int8_gemm_vnni) on AMX tiles: the same int32 dots (exact in
// either) and the same float epilogue, so the outputs equal int8_gemm_vnni's bit for bit.
void int8_gemm_amx(const float* xf, int64_t M, int64_t K, int64_t xs, const int8_t* w, const float* scale, int64_t N,
                   const float* bias, float* y, bool emulated, int num_threads) {
  std::vector<int8_t> quants(static_cast<size_t>(M * K));
  std::vector<float> x_scales(static_cast<size_t>(M));
  for (int64_t m = 0; m < M; ++m) x_scales[m] = quantize_block(xf + m * xs, K, quants.data() + m * K);
  amx_int8_product(quants.data(), M, K, x_scales.data(), w, scale, N, bias, y, emulated, num_threads);
}

#ifdef KVFLOW_QUANT_VNNI
namespace {

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

}  // namespace

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

namespace {

// ---- Q8_0 against x quantized per row (prefill-sized M; AVX-512 VNNI) ----
//
// y[m, n] = d_x[m] * sum_b d_b * sum_{i in b} w_i q_x,i, w_i the block's int8 quants (the kernel is templated on
// the block type): per block an exact int32 dot (vpdpbusd on x shifted to u8, q_x + 128, against the s8 quants, two blocks per
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

}  // namespace

void q8_0_gemm_w8a8(const float* xf, int64_t M, int64_t K, int64_t xs, const uint8_t* w, int64_t N,
                    const float* bias, float* y, int num_threads) {
  w8a8_gemm_vnni<Q8_0Quants>(xf, M, K, xs, w, N, bias, y, num_threads);
}
#endif  // KVFLOW_QUANT_VNNI

}  // namespace quant
}  // namespace kvflow
