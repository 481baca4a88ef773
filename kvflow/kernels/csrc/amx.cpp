// AMX tile products (Sapphire Rapids and later) for prefill-sized M: y = x w^T for bf16 weights (TDPBF16PS, fp32
// sums) and for int8 weights against x quantized per row (TDPBSSD, exact int32 dots).
//
// * The weight is the A operand as it lies in memory: an A tile is 16 weight rows x 64 bytes of K (32 bf16 or 64
//   int8), loaded with the rows' own stride, so weights are never repacked; only a tile that crosses the end of N
//   or K is copied into a zero-padded staging tile first.
// * x is the B operand, packed once per call in the layout the instructions read: B tile (m tile, k chunk c) row
//   kk holds, for each of 16 x rows m, the 4 bytes [64 c + 4 kk, + 4) of row 16 m_tile + m (a bf16 pair or an int8
//   quad); zeros past M and past the row's bytes.
// * A C tile is [16 weight rows][16 x rows] of fp32 / int32, summed over the whole K in one fixed order and stored
//   once, so every output is computed the same way whatever the thread count or the rows beside it.
// * Register blocking: 2 weight tiles x 2 x tiles (C tiles 0-3, A 4-5, B 6-7): 4 tile products per 4 tile loads.
//   Threads split the weight's 16-row tiles into contiguous bands; for each pair of weight tiles every x tile pair
//   runs over the whole K, so the pair (32 rows x K) comes from memory once and from L2 after.
//
// One kernel template runs on two tile backends: the hardware (cpu_features.h: AMX_TILE, AMX_BF16, AMX_INT8 and
// the process's permission for the tile data state) and a scalar emulation of the eight tile registers and the
// three instructions, written from Intel's pseudo-code, which the tests run on every CPU: the packing, staging,
// blocking and edge handling are tested where no AMX exists. The emulation's int8 dots are exact, as the
// hardware's; its bf16 sums follow the pseudo-code's order in fp32 without flushing denormals.
#include "cpu_features.h"
#include "kernels.h"

#ifdef KVFLOW_X86_TARGETS
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common.h"

namespace kvflow {
namespace {

#define KVFLOW_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,amx-int8")))

constexpr int kTileRows = 16;      // rows of every tile
constexpr int kTileBytes = 64;     // bytes per tile row
constexpr int kTileSize = kTileRows * kTileBytes;

// The 64-byte operand of LDTILECFG (palette 1): every tile 16 rows x 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) {
      bytes_per_row[t] = kTileBytes;
      rows[t] = kTileRows;
    }
  }
};

// Calls STEP(t) with the literal tile number T (the intrinsics paste their tile argument into the assembly text).
#define KVFLOW_WITH_TILE(T, STEP)      \
  if constexpr (T == 0) {              \
    STEP(0);                           \
  } else if constexpr (T == 1) {       \
    STEP(1);                           \
  } else if constexpr (T == 2) {       \
    STEP(2);                           \
  } else if constexpr (T == 3) {       \
    STEP(3);                           \
  } else if constexpr (T == 4) {       \
    STEP(4);                           \
  } else if constexpr (T == 5) {       \
    STEP(5);                           \
  } else if constexpr (T == 6) {       \
    STEP(6);                           \
  } else {                             \
    static_assert(T == 7, "tile 0-7"); \
    STEP(7);                           \
  }

// The tile registers and instructions of the CPU. Products use C tiles 0-3 with A tiles 4-5 and B tiles 6-7, as
// tile_block pairs them.
struct HardwareTiles {
  KVFLOW_AMX_TARGET static void configure() {
    const TileConfig config;
    _tile_loadconfig(&config);
  }
  KVFLOW_AMX_TARGET static void release() { _tile_release(); }
  template <int T>
  KVFLOW_AMX_TARGET static void zero() {
#define KVFLOW_STEP(t) _tile_zero(t)
    KVFLOW_WITH_TILE(T, KVFLOW_STEP)
#undef KVFLOW_STEP
  }
  template <int T>
  KVFLOW_AMX_TARGET static void load(const void* base, int64_t stride) {
#define KVFLOW_STEP(t) _tile_loadd(t, base, stride)
    KVFLOW_WITH_TILE(T, KVFLOW_STEP)
#undef KVFLOW_STEP
  }
  template <int T>
  KVFLOW_AMX_TARGET static void store(void* base) {
#define KVFLOW_STEP(t) _tile_stored(t, base, kTileBytes)
    KVFLOW_WITH_TILE(T, KVFLOW_STEP)
#undef KVFLOW_STEP
  }
  template <int C, int A, int B>
  KVFLOW_AMX_TARGET static void dot_bf16() {
    static_assert(C < 4 && A == 4 + C / 2 && B == 6 + C % 2, "C tile 2 n + m = A tile 4 + n times B tile 6 + m");
    if constexpr (C == 0)
      _tile_dpbf16ps(0, 4, 6);
    else if constexpr (C == 1)
      _tile_dpbf16ps(1, 4, 7);
    else if constexpr (C == 2)
      _tile_dpbf16ps(2, 5, 6);
    else
      _tile_dpbf16ps(3, 5, 7);
  }
  template <int C, int A, int B>
  KVFLOW_AMX_TARGET static void dot_int8() {
    static_assert(C < 4 && A == 4 + C / 2 && B == 6 + C % 2, "C tile 2 n + m = A tile 4 + n times B tile 6 + m");
    if constexpr (C == 0)
      _tile_dpbssd(0, 4, 6);
    else if constexpr (C == 1)
      _tile_dpbssd(1, 4, 7);
    else if constexpr (C == 2)
      _tile_dpbssd(2, 5, 6);
    else
      _tile_dpbssd(3, 5, 7);
  }
};

// The same, emulated: eight 1 KiB registers per thread.
struct EmulatedTiles {
  struct Registers {
    alignas(64) uint8_t tile[8][kTileSize];
  };
  static inline thread_local Registers registers;

  static void configure() {}
  static void release() {}
  template <int T>
  static void zero() {
    std::memset(registers.tile[T], 0, kTileSize);
  }
  template <int T>
  static void load(const void* base, int64_t stride) {
    for (int r = 0; r < kTileRows; ++r)
      std::memcpy(registers.tile[T] + r * kTileBytes, static_cast<const uint8_t*>(base) + r * stride, kTileBytes);
  }
  template <int T>
  static void store(void* base) {
    std::memcpy(base, registers.tile[T], kTileSize);
  }
  // TDPBF16PS: c[m][n] += a[m][2k] b[k][2n] + a[m][2k + 1] b[k][2n + 1], over k in order, each product added alone.
  template <int C, int A, int B>
  static void dot_bf16() {
    float c[kTileRows][16];
    bf16 a[kTileRows][32], b[kTileRows][32];
    std::memcpy(c, registers.tile[C], kTileSize);
    std::memcpy(a, registers.tile[A], kTileSize);
    std::memcpy(b, registers.tile[B], kTileSize);
    for (int m = 0; m < kTileRows; ++m)
      for (int k = 0; k < 16; ++k)
        for (int n = 0; n < 16; ++n) {
          c[m][n] += bf16_to_float(a[m][2 * k]) * bf16_to_float(b[k][2 * n]);
          c[m][n] += bf16_to_float(a[m][2 * k + 1]) * bf16_to_float(b[k][2 * n + 1]);
        }
    std::memcpy(registers.tile[C], c, kTileSize);
  }
  // TDPBSSD: c[m][n] += sum_i a[m][4k + i] b[k][4n + i], signed bytes, int32 sums.
  template <int C, int A, int B>
  static void dot_int8() {
    int32_t c[kTileRows][16];
    int8_t a[kTileRows][64], b[kTileRows][64];
    std::memcpy(c, registers.tile[C], kTileSize);
    std::memcpy(a, registers.tile[A], kTileSize);
    std::memcpy(b, registers.tile[B], kTileSize);
    for (int m = 0; m < kTileRows; ++m)
      for (int k = 0; k < 16; ++k)
        for (int n = 0; n < 16; ++n)
          for (int i = 0; i < 4; ++i) c[m][n] += int32_t{a[m][4 * k + i]} * int32_t{b[k][4 * n + i]};
    std::memcpy(registers.tile[C], c, kTileSize);
  }
};

struct Bf16Dots {
  template <class Tiles, int C, int A, int B>
  static void dot() {
    Tiles::template dot_bf16<C, A, B>();
  }
};
struct Int8Dots {
  template <class Tiles, int C, int A, int B>
  static void dot() {
    Tiles::template dot_int8<C, A, B>();
  }
};

// x rows packed as B tiles (see the top): tile (m tile, chunk) at data[(m_tile * chunks + chunk) * kTileSize].
struct PackedX {
  int64_t m_tiles, chunks;
  std::vector<uint8_t> data;

  // `rows` x rows of `row_bytes` bytes, `stride` bytes apart; threads split the x tiles (each writes whole tiles).
  PackedX(const uint8_t* rows, int64_t M, int64_t row_bytes, int64_t stride, int num_threads)
      : m_tiles((M + kTileRows - 1) / kTileRows),
        chunks((row_bytes + kTileBytes - 1) / kTileBytes),
        data(static_cast<size_t>(m_tiles * chunks * kTileSize), 0) {
    const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, m_tiles)));
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t m_tile = 0; m_tile < m_tiles; ++m_tile)
      for (int64_t m = m_tile * kTileRows; m < std::min(M, (m_tile + 1) * kTileRows); ++m) {
        const uint8_t* row = rows + m * stride;
        uint8_t* column = data.data() + m_tile * chunks * kTileSize + (m % kTileRows) * 4;
        const int64_t whole = row_bytes / 4;  // dword d lands in chunk d / 16, tile row d % 16
        for (int64_t d = 0; d < whole; ++d)
          std::memcpy(column + (d / 16) * kTileSize + (d % 16) * kTileBytes, row + 4 * d, 4);
        for (int64_t byte = whole * 4; byte < row_bytes; ++byte)  // a last partial dword (odd K in bf16)
          column[(byte / kTileBytes) * kTileSize + (byte % kTileBytes / 4) * kTileBytes + byte % 4] = row[byte];
      }
  }
  const uint8_t* tile(int64_t m_tile, int64_t chunk) const {
    return data.data() + (m_tile * chunks + chunk) * kTileSize;
  }
};

// The weight: N rows of row_bytes bytes, contiguous.
struct Weights {
  const uint8_t* rows;
  int64_t N, row_bytes;
};

// Loads A tile T: weight rows [n0, n0 + 16) x bytes [64 chunk, + 64); through `staging` (zeros past N and past
// the row) where the tile crosses either end.
template <class Tiles, int T>
void load_weight_tile(const Weights& w, int64_t n0, int64_t chunk, uint8_t* staging) {
  const int64_t first = chunk * kTileBytes;
  if (n0 + kTileRows <= w.N && first + kTileBytes <= w.row_bytes) {
    Tiles::template load<T>(w.rows + n0 * w.row_bytes + first, w.row_bytes);
    return;
  }
  std::memset(staging, 0, kTileSize);
  const int64_t rows = std::min<int64_t>(kTileRows, w.N - n0);
  const int64_t bytes = std::min<int64_t>(kTileBytes, w.row_bytes - first);
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(staging + r * kTileBytes, w.rows + (n0 + r) * w.row_bytes + first, bytes);
  Tiles::template load<T>(staging, kTileBytes);
}

// C tiles (2 n + m) = weight tiles [n_tile, n_tile + PN) x x tiles [m_tile, m_tile + PM) over every chunk, then
// handed to epilogue(n0, m0, c) with c the stored [16 weight rows][16 x rows] tile.
template <class Tiles, class Dots, int PN, int PM, class Epilogue>
void tile_block(const Weights& w, const PackedX& x, int64_t n_tile, int64_t m_tile, uint8_t* staging,
                uint8_t* c_tile, Epilogue& epilogue) {
  Tiles::template zero<0>();
  if constexpr (PM == 2) Tiles::template zero<1>();
  if constexpr (PN == 2) Tiles::template zero<2>();
  if constexpr (PN == 2 && PM == 2) Tiles::template zero<3>();
  const int64_t n0 = n_tile * kTileRows;
  for (int64_t chunk = 0; chunk < x.chunks; ++chunk) {
    load_weight_tile<Tiles, 4>(w, n0, chunk, staging);
    if constexpr (PN == 2) load_weight_tile<Tiles, 5>(w, n0 + kTileRows, chunk, staging + kTileSize);
    Tiles::template load<6>(x.tile(m_tile, chunk), kTileBytes);
    if constexpr (PM == 2) Tiles::template load<7>(x.tile(m_tile + 1, chunk), kTileBytes);
    Dots::template dot<Tiles, 0, 4, 6>();
    if constexpr (PM == 2) Dots::template dot<Tiles, 1, 4, 7>();
    if constexpr (PN == 2) Dots::template dot<Tiles, 2, 5, 6>();
    if constexpr (PN == 2 && PM == 2) Dots::template dot<Tiles, 3, 5, 7>();
  }
  const int64_t m0 = m_tile * kTileRows;
  Tiles::template store<0>(c_tile);
  epilogue(n0, m0, c_tile);
  if constexpr (PM == 2) {
    Tiles::template store<1>(c_tile);
    epilogue(n0, m0 + kTileRows, c_tile);
  }
  if constexpr (PN == 2) {
    Tiles::template store<2>(c_tile);
    epilogue(n0 + kTileRows, m0, c_tile);
  }
  if constexpr (PN == 2 && PM == 2) {
    Tiles::template store<3>(c_tile);
    epilogue(n0 + kTileRows, m0 + kTileRows, c_tile);
  }
}

template <class Tiles, class Dots, class Epilogue>
void tile_product(const Weights& w, const PackedX& x, Epilogue epilogue, int num_threads) {
  const int64_t n_tiles = (w.N + kTileRows - 1) / kTileRows;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, (n_tiles + 1) / 2)));
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t begin = n_tiles * t / nt, end = n_tiles * (t + 1) / nt;
    alignas(64) uint8_t staging[2 * kTileSize];
    alignas(64) uint8_t c_tile[kTileSize];
    Tiles::configure();
    for (int64_t n_tile = begin; n_tile < end; n_tile += 2)
      for (int64_t m_tile = 0; m_tile < x.m_tiles; m_tile += 2) {
        const bool two_n = n_tile + 1 < end, two_m = m_tile + 1 < x.m_tiles;
        if (two_n && two_m)
          tile_block<Tiles, Dots, 2, 2>(w, x, n_tile, m_tile, staging, c_tile, epilogue);
        else if (two_n)
          tile_block<Tiles, Dots, 2, 1>(w, x, n_tile, m_tile, staging, c_tile, epilogue);
        else if (two_m)
          tile_block<Tiles, Dots, 1, 2>(w, x, n_tile, m_tile, staging, c_tile, epilogue);
        else
          tile_block<Tiles, Dots, 1, 1>(w, x, n_tile, m_tile, staging, c_tile, epilogue);
      }
    Tiles::release();
  }
}

template <class Dots, class Epilogue>
void run_tile_product(bool emulated, const Weights& w, const PackedX& x, Epilogue epilogue, int num_threads) {
  if (emulated)
    tile_product<EmulatedTiles, Dots>(w, x, epilogue, num_threads);
  else
    tile_product<HardwareTiles, Dots>(w, x, epilogue, num_threads);
}

}  // namespace

void amx_gemm_bf16(const bf16* x, int64_t M, int64_t K, int64_t x_stride, const bf16* w, int64_t N, const bf16* bias,
                   bf16* y, float* y_float, bool emulated, int num_threads) {
  const int64_t row_bytes = K * static_cast<int64_t>(sizeof(bf16));
  const PackedX packed(reinterpret_cast<const uint8_t*>(x), M, row_bytes,
                       x_stride * static_cast<int64_t>(sizeof(bf16)), num_threads);
  const Weights weights{reinterpret_cast<const uint8_t*>(w), N, row_bytes};
  auto epilogue = [&](int64_t n0, int64_t m0, const uint8_t* tile) {
    float sums[kTileRows][16];
    std::memcpy(sums, tile, kTileSize);
    for (int64_t m = m0; m < std::min(M, m0 + kTileRows); ++m)
      for (int64_t n = n0; n < std::min(N, n0 + kTileRows); ++n) {
        const float value = sums[n - n0][m - m0] + (bias ? bf16_to_float(bias[n]) : 0.f);
        if (y_float)
          y_float[m * N + n] = round_to<bf16>(value);
        else
          y[m * N + n] = float_to_bf16(value);
      }
  };
  run_tile_product<Bf16Dots>(emulated, weights, packed, epilogue, num_threads);
}

void amx_int8_product(const int8_t* quants, int64_t M, int64_t K, const float* x_scales, const int8_t* w,
                      const float* w_scales, int64_t N, const float* bias, float* y, bool emulated, int num_threads) {
  const PackedX packed(reinterpret_cast<const uint8_t*>(quants), M, K, K, num_threads);
  const Weights weights{reinterpret_cast<const uint8_t*>(w), N, K};
  auto epilogue = [&](int64_t n0, int64_t m0, const uint8_t* tile) {
    int32_t dots[kTileRows][16];
    std::memcpy(dots, tile, kTileSize);
    for (int64_t m = m0; m < std::min(M, m0 + kTileRows); ++m)
      for (int64_t n = n0; n < std::min(N, n0 + kTileRows); ++n) {
        const float total = static_cast<float>(dots[n - n0][m - m0]);
        y[m * N + n] = total * (x_scales[m] * w_scales[n]) + (bias ? bias[n] : 0.f);
      }
  };
  run_tile_product<Int8Dots>(emulated, weights, packed, epilogue, num_threads);
}

}  // namespace kvflow

#else  // no x86-64 AMX targets in this compiler: nothing dispatches here (cpu_features.h reports no AMX)

#include <stdexcept>

namespace kvflow {

void amx_gemm_bf16(const bf16*, int64_t, int64_t, int64_t, const bf16*, int64_t, const bf16*, bf16*, float*, bool,
                   int) {
  throw std::runtime_error("AMX kernels need an x86-64 build with a compiler that knows the amx targets");
}

void amx_int8_product(const int8_t*, int64_t, int64_t, const float*, const int8_t*, const float*, int64_t,
                      const float*, float*, bool, int) {
  throw std::runtime_error("AMX kernels need an x86-64 build with a compiler that knows the amx targets");
}

}  // namespace kvflow

#endif
