// The tiled product on dequantized weights (more rows than the GEMV takes, where no integer product runs): per
// thread, tiles of kTileRows weight rows and kTileK columns are dequantized into a thread-local fp32 buffer (L1/L2)
// and every x row runs against it in 4 x 3 register blocks: the weights are read from memory once per call
// whatever M is.
#include <omp.h>

#include "quant_internal.h"

namespace kvflow {
namespace quant {
namespace {

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

}  // namespace

void ggml_tiled_product(const float* xf, int64_t M, int64_t K, int64_t xs, const uint8_t* w, int64_t N, int type,
                        const float* bias, float* y, int num_threads) {
  const int64_t elements = ggml_block_elements(type), bytes = ggml_block_bytes(type);
  const GgmlDecode decode{w, K / elements * bytes, elements, bytes, block_dequantizer(type)};
  tiled_product(decode, xf, M, K, xs, N, nullptr, bias, y, num_threads);
}

void int8_tiled_product(const float* xf, int64_t M, int64_t K, int64_t xs, const int8_t* w, const float* scale,
                        int64_t N, const float* bias, float* y, int num_threads) {
  tiled_product(Int8Decode{w, K}, xf, M, K, xs, N, scale, bias, y, num_threads);
}

}  // namespace quant
}  // namespace kvflow
