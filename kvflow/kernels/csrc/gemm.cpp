// bf16 GEMM for prefill-sized M on AVX-512 CPUs. gemm() runs one of three kernels (default_gemm_kernel): AMX tiles
// (amx.cpp), vdpbf16ps on the weights in place (below, AMD CPUs with AVX512_BF16), or, everywhere else, the
// widened-fp32 kernel first in this file: without native bf16 matmul the library's bf16 GEMM runs at a fraction of
// its fp32 rate, so this kernel widens the bf16 weight to fp32 once per cache-sized block and runs an fp32 FMA
// microkernel over it.
//
// Layout, per call:
// * x (M rows, row stride x_stride) is converted once to fp32 in tiles of kMT rows (the last one shorter), K padded
//   to a multiple of 16 with zeros: tile t is xf[t * kMT * k_steps * 16 + (k step * rows in tile + row) * 16 + lane].
// * Threads split the weight's rows into contiguous bands of kNB-row blocks. Per block and per K block (at most
//   kKB wide, so a tile of x fits L1 and the packed weights L2), the weight block is widened into a thread-local
//   buffer wp[row group of kR][k step][row in group][16] (rows past N and k past K are zeros), and every x tile
//   runs against every row group of it: each weight byte comes from DRAM once per call.
// * The microkernel holds kR x (rows in tile) accumulators of 16 k lanes each; after a K block transposing trees
//   reduce each 4 x 4 of them to one vector of 16 dot products, added into a thread-local fp32 block of results.
//   The last K block's results get the bias, are rounded once to bf16 (round-to-nearest-even, as torch), stored.
// * Prefetches into L2, spread over the compute: the next weight block's rows (one line per row segment per k step,
//   so its DRAM reads overlap FMAs rather than stall the packing) and the next x tile (x outgrows L2 at M = 256,
//   K = 4864).
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <stdexcept>

#include "common.h"
#include "cpu_features.h"
#include "kernels.h"

namespace kvflow {

#ifdef KVFLOW_AVX512
namespace {

constexpr int kR = 4;             // weight rows per microkernel tile
constexpr int kMT = 6;            // x rows per microkernel tile: 4 x 6 accumulators + 6 x vectors + 1 weight
constexpr int64_t kNB = 64;       // weight rows per block (a multiple of kR)
constexpr int64_t kMC = 512;      // rows of x per pass over the weight: bounds the scratch buffers (x: 10 MiB at
                                  // K = 4864); 512 FMAs per weight element make the extra weight reads negligible
constexpr int64_t kKB = 1024;     // widest K block (a multiple of 16): a 6-row x tile is 24 KiB, a block 256 KiB

// A 64-byte aligned float buffer that only grows: one per thread, reused across calls (no page faults per call).
struct Scratch {
  float* data = nullptr;
  size_t size = 0;
  float* get(size_t count) {
    if (count > size) {
      std::free(data);
      data = static_cast<float*>(std::aligned_alloc(64, (count * sizeof(float) + 63) / 64 * 64));
      size = count;
    }
    return data;
  }
  ~Scratch() { std::free(data); }
};

// Sums each of 16 vectors across its lanes: element 4 * c + j of the result is the sum of v[4 * j + c].
inline __m512 reduce16(const __m512 v[16]) {
  __m512 pairs[8], quads[4], octs[2];
  for (int i = 0; i < 8; ++i) {  // 128-bit chunks: [a0 + a2, a1 + a3, b0 + b2, b1 + b3]
    __m512 low = _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0));
    __m512 high = _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2));
    pairs[i] = _mm512_add_ps(low, high);
  }
  for (int i = 0; i < 4; ++i) {  // chunk c holds 4 partial sums of v[4 * i + c]
    __m512 even = _mm512_shuffle_f32x4(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0));
    __m512 odd = _mm512_shuffle_f32x4(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1));
    quads[i] = _mm512_add_ps(even, odd);
  }
  for (int i = 0; i < 2; ++i) {  // chunk c: [2 partials of v[8i + c], 2 partials of v[8i + 4 + c]]
    __m512 low = _mm512_shuffle_ps(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0));
    __m512 high = _mm512_shuffle_ps(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2));
    octs[i] = _mm512_add_ps(low, high);
  }
  __m512 even = _mm512_shuffle_ps(octs[0], octs[1], _MM_SHUFFLE(2, 0, 2, 0));
  __m512 odd = _mm512_shuffle_ps(octs[0], octs[1], _MM_SHUFFLE(3, 1, 3, 1));
  return _mm512_add_ps(even, odd);
}

// Stores (or, with `accumulate`, adds) the kR x MT dot products whose 16 k lanes acc[r][m] holds to
// out[m * out_stride + r].
template <int MT>
inline void store_tile_sums(const __m512 acc[kR][MT], float* out, int64_t out_stride, bool accumulate) {
  alignas(64) float sums[16];
  for (int g = 0; g < MT; g += 4) {  // x rows g .. g + 3 (zeros past MT)
    __m512 v[16];
    for (int r = 0; r < kR; ++r)
      for (int c = 0; c < 4; ++c) v[4 * r + c] = g + c < MT ? acc[r][g + c] : _mm512_setzero_ps();
    _mm512_store_ps(sums, reduce16(v));  // sums[4 * c + r]: x row g + c times weight row r
    for (int c = 0; c < 4 && g + c < MT; ++c) {
      float* target = out + (g + c) * out_stride;
      const __m128 part = _mm_load_ps(sums + 4 * c);
      _mm_storeu_ps(target, accumulate ? _mm_add_ps(_mm_loadu_ps(target), part) : part);
    }
  }
}

// Row segments of weights to prefetch: `rows` segments of `lines` 64-byte lines, `stride` bytes apart.
struct PrefetchRows {
  const char* base = nullptr;
  int64_t stride = 0, rows = 0, lines = 0;
};

// The kR x MT dot products of a packed weight group (rows g .. g + 3) and a packed x tile of MT rows over `steps`
// k steps of 16, stored to (or, with `accumulate`, added to) out[m * out_stride + r]. Meanwhile `prefetch`'s lines
// are requested one per segment per step: spread out, the next weight block's DRAM reads overlap these FMAs.
template <int MT>
inline void tile_dots(const float* w, const float* x, int64_t steps, float* out, int64_t out_stride, bool accumulate,
                      const PrefetchRows& prefetch) {
  static_assert(kR == 4 && kMT <= 6, "reduce16 maps 4 weight rows x 4 x rows; gemm_rows 6 tiles");
  __m512 acc[kR][MT];
  for (int r = 0; r < kR; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t s = 0; s < steps; ++s, w += kR * 16, x += MT * 16) {
    if (s < prefetch.lines)
      for (int64_t j = 0; j < prefetch.rows; ++j)
        _mm_prefetch(prefetch.base + j * prefetch.stride + s * 64, _MM_HINT_T1);
    __m512 xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = _mm512_load_ps(x + m * 16);
    for (int r = 0; r < kR; ++r) {
      const __m512 wv = _mm512_load_ps(w + r * 16);
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);
    }
  }
  store_tile_sums<MT>(acc, out, out_stride, accumulate);
}

// tile_dots on float32 weight rows as they lie in memory (`rows`, columns [k0, k0 + 16 steps), zeros past K):
// the same FMAs in the same order as on a packed group, without the copy.
template <int MT>
inline void tile_dots_rows(const float* const rows[kR], int64_t K, int64_t k0, const float* x, int64_t steps,
                           float* out, int64_t out_stride, bool accumulate, const PrefetchRows& prefetch) {
  __m512 acc[kR][MT];
  for (int r = 0; r < kR; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t s = 0; s < steps; ++s, x += MT * 16) {
    if (s < prefetch.lines)
      for (int64_t j = 0; j < prefetch.rows; ++j)
        _mm_prefetch(prefetch.base + j * prefetch.stride + s * 64, _MM_HINT_T1);
    const int64_t k = k0 + s * 16;
    const __mmask16 mask = tail_mask(std::max<int64_t>(0, K - k));
    __m512 xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = _mm512_load_ps(x + m * 16);
    for (int r = 0; r < kR; ++r) {
      const __m512 wv = _mm512_maskz_loadu_ps(mask, rows[r] + k);
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);
    }
  }
  store_tile_sums<MT>(acc, out, out_stride, accumulate);
}

// Widens rows [n0, n0 + rows) x columns [k0, k0 + steps * 16) of w into wp (zeros past N and K).
template <typename T>
void pack_weights(const T* w, int64_t N, int64_t K, int64_t n0, int64_t rows, int64_t k0, int64_t steps,
                  float* wp) {
  for (int64_t g = 0; g < rows; g += kR)
    for (int r = 0; r < kR; ++r) {
      const int64_t n = n0 + g + r;
      float* out = wp + g * steps * 16 + r * 16;
      if (n >= N) {
        for (int64_t s = 0; s < steps; ++s) _mm512_store_ps(out + s * kR * 16, _mm512_setzero_ps());
        continue;
      }
      const T* row = w + n * K;
      for (int64_t s = 0; s < steps; ++s) {
        const int64_t k = k0 + s * 16;
        __m512 v = k + 16 <= K ? load16(row + k) : load16(row + k, tail_mask(std::max<int64_t>(0, K - k)));
        _mm512_store_ps(out + s * kR * 16, v);
      }
    }
}

// Converts x tiles [t_begin, t_end) into xf (zeros past K).
template <typename T>
void pack_x(const T* x, int64_t M, int64_t K, int64_t x_stride, int64_t k_steps, int64_t t_begin, int64_t t_end,
            float* xf) {
  for (int64_t t = t_begin; t < t_end; ++t) {
    const int64_t m0 = t * kMT, height = std::min<int64_t>(kMT, M - m0);
    float* tile = xf + m0 * k_steps * 16;
    for (int64_t m = 0; m < height; ++m) {
      const T* row = x + (m0 + m) * x_stride;
      for (int64_t s = 0; s < k_steps; ++s) {
        const int64_t k = s * 16;
        const __m512 v = k + 16 <= K ? load16(row + k) : load16(row + k, tail_mask(K - k));
        _mm512_store_ps(tile + (s * height + m) * 16, v);
      }
    }
  }
}

// Adds bias to the fp32 results of rows [n0, n0 + count) and stores them rounded to T (or as rounded floats).
template <typename T>
void store_block(const float* acc, int64_t acc_stride, int64_t M, int64_t N, int64_t n0, int64_t count,
                 const T* bias, T* y, float* y_float) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < count; j += 16) {
      const __mmask16 mask = tail_mask(count - j);
      __m512 value = _mm512_maskz_loadu_ps(mask, acc + m * acc_stride + j);
      if (bias) value = _mm512_add_ps(value, load16(bias + n0 + j, mask));
      if (y_float)
        store16(y_float + m * N + n0 + j, round16<T>(value), mask);
      else
        store16(y + m * N + n0 + j, value, mask);
    }
}

// gemm for at most kMC rows of x (T = bf16: weights widened per block; float: read in place, tile_dots_rows).
template <typename T>
void gemm_rows(const T* x, int64_t M, int64_t K, int64_t x_stride, const T* w, int64_t N, const T* bias, T* y,
               float* y_float, int num_threads) {
  const int64_t k_steps = (K + 15) / 16;
  const int64_t tiles = (M + kMT - 1) / kMT;
  const int64_t k_blocks = (k_steps * 16 + kKB - 1) / kKB;
  const int64_t kb_steps = (k_steps + k_blocks - 1) / k_blocks;  // K blocks of near-equal width
  const int64_t n_blocks = (N + kNB - 1) / kNB;
  constexpr bool kInPlace = sizeof(T) == sizeof(float);  // float32 weights are read where they lie
  static thread_local Scratch x_scratch;  // the calling thread's; the team reads it after the barrier
  float* xf = x_scratch.get(static_cast<size_t>(M * k_steps * 16));
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, n_blocks)));
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    pack_x(x, M, K, x_stride, k_steps, tiles * t / nt, tiles * (t + 1) / nt, xf);
    static thread_local Scratch w_scratch, acc_scratch;
    float* wp = w_scratch.get(static_cast<size_t>(kNB * kb_steps * 16));
    float* acc = acc_scratch.get(static_cast<size_t>(M * kNB));
#pragma omp barrier
    const int64_t b_end = n_blocks * (t + 1) / nt;
    for (int64_t b = n_blocks * t / nt; b < b_end; ++b) {
      const int64_t n0 = b * kNB, count = std::min(kNB, N - n0);
      const int64_t rows = (count + kR - 1) / kR * kR;
      for (int64_t kb = 0; kb < k_blocks; ++kb) {
        const int64_t s0 = kb * kb_steps, steps = std::min(kb_steps, k_steps - s0);
        if constexpr (!kInPlace) pack_weights(w, N, K, n0, rows, s0 * 16, steps, wp);
        // The next (block, K block) this thread packs, prefetched during this one's tile_dots calls: call c takes
        // row segments [c * per_call, (c + 1) * per_call).
        const bool last_kb = kb + 1 == k_blocks;
        const int64_t next_n0 = last_kb ? n0 + kNB : n0, next_s0 = last_kb ? 0 : s0 + kb_steps;
        const int64_t next_rows = last_kb && b + 1 == b_end ? 0 : std::min(kNB, N - next_n0);
        const int64_t calls = tiles * (rows / kR);
        const int64_t per_call = (next_rows + calls - 1) / calls;
        PrefetchRows prefetch;
        prefetch.stride = K * static_cast<int64_t>(sizeof(T));
        prefetch.lines = (std::min(kb_steps, k_steps - next_s0) * 16 * static_cast<int64_t>(sizeof(T)) + 63) / 64;
        const char* next_base = reinterpret_cast<const char*>(w + next_n0 * K + next_s0 * 16);
        int64_t call = 0;
        for (int64_t tile = 0; tile < tiles; ++tile) {
          const int64_t m0 = tile * kMT, height = std::min<int64_t>(kMT, M - m0);
          const float* xt = xf + (m0 * k_steps + s0 * height) * 16;
          // the next tile's slice of x (in L3 when x outgrows L2) is fetched into L2 during this tile's groups
          const int64_t next_height = std::min<int64_t>(kMT, M - m0 - kMT);
          const char* next_x = reinterpret_cast<const char*>(xf + ((m0 + kMT) * k_steps + s0 * next_height) * 16);
          const int64_t next_lines = tile + 1 < tiles ? next_height * steps : 0;  // 64-byte lines
          const int64_t lines_per_group = (next_lines + rows / kR - 1) / (rows / kR);
          int64_t next_line = 0;
          for (int64_t g = 0; g < rows; g += kR) {
            for (const int64_t end = std::min(next_lines, next_line + lines_per_group); next_line < end; ++next_line)
              _mm_prefetch(next_x + next_line * 64, _MM_HINT_T1);
            const float* wg = wp + g * steps * 16;
            float* out = acc + m0 * kNB + g;
            const int64_t first = std::min(next_rows, call * per_call);
            prefetch.rows = std::min(next_rows, first + per_call) - first;
            prefetch.base = next_base + first * prefetch.stride;
            ++call;
            if constexpr (kInPlace) {
              const float* wrows[kR];  // rows past N repeat the last one; their sums land in unused columns
              for (int r = 0; r < kR; ++r) wrows[r] = w + std::min(n0 + g + r, N - 1) * K;
              switch (height) {
                case 6: tile_dots_rows<6>(wrows, K, s0 * 16, xt, steps, out, kNB, kb > 0, prefetch); break;
                case 5: tile_dots_rows<5>(wrows, K, s0 * 16, xt, steps, out, kNB, kb > 0, prefetch); break;
                case 4: tile_dots_rows<4>(wrows, K, s0 * 16, xt, steps, out, kNB, kb > 0, prefetch); break;
                case 3: tile_dots_rows<3>(wrows, K, s0 * 16, xt, steps, out, kNB, kb > 0, prefetch); break;
                case 2: tile_dots_rows<2>(wrows, K, s0 * 16, xt, steps, out, kNB, kb > 0, prefetch); break;
                default: tile_dots_rows<1>(wrows, K, s0 * 16, xt, steps, out, kNB, kb > 0, prefetch); break;
              }
              continue;
            }
            switch (height) {
              case 6: tile_dots<6>(wg, xt, steps, out, kNB, kb > 0, prefetch); break;
              case 5: tile_dots<5>(wg, xt, steps, out, kNB, kb > 0, prefetch); break;
              case 4: tile_dots<4>(wg, xt, steps, out, kNB, kb > 0, prefetch); break;
              case 3: tile_dots<3>(wg, xt, steps, out, kNB, kb > 0, prefetch); break;
              case 2: tile_dots<2>(wg, xt, steps, out, kNB, kb > 0, prefetch); break;
              default: tile_dots<1>(wg, xt, steps, out, kNB, kb > 0, prefetch); break;
            }
          }
        }
      }
      store_block(acc, kNB, M, N, n0, count, bias, y, y_float);
    }
  }
}

#ifdef KVFLOW_X86_TARGETS
// ---- AVX512_BF16: vdpbf16ps on the weights as they lie in memory ----
//
// The same blocking as above without the widening pass: per k step of 32 columns, each of the kR weight rows is
// one 64-byte load straight from w (masked to zeros past K) and one vdpbf16ps per x row adds 32 products into 16
// fp32 lanes (pairs summed in the instruction, then into the lane: Intel's pseudo-code, round-to-nearest-even,
// denormal inputs and outputs flushed to zero). x is copied once per call into bf16 tiles of kMT rows, K padded
// to a multiple of 32 with zeros: tile t is xb[t * kMT * k_steps * 32 + (k step * rows in tile + row) * 32 + lane].
// A K block of a 64-row weight block (kBf16KB columns, 256 KiB) stays in L2 while every x tile runs against it.
#define KVFLOW_BF16_TARGET __attribute__((target("avx512bf16")))

constexpr int64_t kBf16KB = 2048;  // widest K block (a multiple of 32): 4 KiB per weight row

// Copies x tiles [t_begin, t_end) into xb (zeros past K).
void pack_x_bf16(const bf16* x, int64_t M, int64_t K, int64_t x_stride, int64_t k_steps, int64_t t_begin,
                 int64_t t_end, bf16* xb) {
  for (int64_t t = t_begin; t < t_end; ++t) {
    const int64_t m0 = t * kMT, height = std::min<int64_t>(kMT, M - m0);
    bf16* tile = xb + m0 * k_steps * 32;
    for (int64_t m = 0; m < height; ++m) {
      const bf16* row = x + (m0 + m) * x_stride;
      for (int64_t s = 0; s < k_steps; ++s) {
        const int64_t k = s * 32, left = K - k;
        const __mmask32 mask = left >= 32 ? ~static_cast<__mmask32>(0) : (static_cast<__mmask32>(1) << left) - 1;
        _mm512_store_si512(tile + (s * height + m) * 32, _mm512_maskz_loadu_epi16(mask, row + k));
      }
    }
  }
}

// acc[r][m] += the 32 products of weight rows `rows` at column k (masked: zeros) and x tile rows x[m * 32 ...].
template <int MT>
KVFLOW_BF16_TARGET inline void dot_step_bf16(const bf16* const rows[kR], int64_t k, __mmask32 mask, const bf16* x,
                                             __m512 acc[kR][MT]) {
  __m512bh xv[MT];
  for (int m = 0; m < MT; ++m) xv[m] = (__m512bh)_mm512_load_si512(x + m * 32);
  for (int r = 0; r < kR; ++r) {
    const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, rows[r] + k);
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
  }
}

// The kR x MT dot products of weight rows `rows` (columns [k0, k0 + 32 steps), zeros past K) and a packed x tile
// of MT rows, stored to (or, with `accumulate`, added to) out[m * out_stride + r].
template <int MT>
KVFLOW_BF16_TARGET void tile_dots_bf16(const bf16* const rows[kR], int64_t K, int64_t k0, int64_t steps,
                                       const bf16* x, float* out, int64_t out_stride, bool accumulate) {
  __m512 acc[kR][MT];
  for (int r = 0; r < kR; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
  const int64_t full = std::min(steps, (K - k0) / 32);  // steps whose 32 columns all lie below K
  for (int64_t s = 0; s < full; ++s, x += MT * 32)
    dot_step_bf16<MT>(rows, k0 + s * 32, ~static_cast<__mmask32>(0), x, acc);
  for (int64_t s = full; s < steps; ++s, x += MT * 32) {
    const int64_t k = k0 + s * 32;
    dot_step_bf16<MT>(rows, k, (static_cast<__mmask32>(1) << (K - k)) - 1, x, acc);
  }
  store_tile_sums<MT>(acc, out, out_stride, accumulate);
}

// The vdpbf16ps kernel for at most kMC rows of x.
void gemm_rows_dpbf16(const bf16* x, int64_t M, int64_t K, int64_t x_stride, const bf16* w, int64_t N,
                      const bf16* bias, bf16* y, float* y_float, int num_threads) {
  const int64_t k_steps = (K + 31) / 32;
  const int64_t tiles = (M + kMT - 1) / kMT;
  const int64_t k_blocks = (k_steps * 32 + kBf16KB - 1) / kBf16KB;
  const int64_t kb_steps = (k_steps + k_blocks - 1) / k_blocks;
  const int64_t n_blocks = (N + kNB - 1) / kNB;
  static thread_local Scratch x_scratch;  // floats, used as bf16 pairs
  bf16* xb = reinterpret_cast<bf16*>(x_scratch.get(static_cast<size_t>(M * k_steps * 16)));
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, n_blocks)));
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    pack_x_bf16(x, M, K, x_stride, k_steps, tiles * t / nt, tiles * (t + 1) / nt, xb);
    static thread_local Scratch acc_scratch;
    float* acc = acc_scratch.get(static_cast<size_t>(M * kNB));
#pragma omp barrier
    for (int64_t b = n_blocks * t / nt, b_end = n_blocks * (t + 1) / nt; b < b_end; ++b) {
      const int64_t n0 = b * kNB, count = std::min(kNB, N - n0);
      for (int64_t kb = 0; kb < k_blocks; ++kb) {
        const int64_t s0 = kb * kb_steps, steps = std::min(kb_steps, k_steps - s0);
        for (int64_t tile = 0; tile < tiles; ++tile) {
          const int64_t m0 = tile * kMT, height = std::min<int64_t>(kMT, M - m0);
          const bf16* xt = xb + (m0 * k_steps + s0 * height) * 32;
          for (int64_t g = 0; g < count; g += kR) {
            const bf16* rows[kR];  // rows past N repeat the last one; their sums land in unused columns
            for (int r = 0; r < kR; ++r) rows[r] = w + std::min(n0 + g + r, N - 1) * K;
            float* out = acc + m0 * kNB + g;
            switch (height) {
              case 6: tile_dots_bf16<6>(rows, K, s0 * 32, steps, xt, out, kNB, kb > 0); break;
              case 5: tile_dots_bf16<5>(rows, K, s0 * 32, steps, xt, out, kNB, kb > 0); break;
              case 4: tile_dots_bf16<4>(rows, K, s0 * 32, steps, xt, out, kNB, kb > 0); break;
              case 3: tile_dots_bf16<3>(rows, K, s0 * 32, steps, xt, out, kNB, kb > 0); break;
              case 2: tile_dots_bf16<2>(rows, K, s0 * 32, steps, xt, out, kNB, kb > 0); break;
              default: tile_dots_bf16<1>(rows, K, s0 * 32, steps, xt, out, kNB, kb > 0); break;
            }
          }
        }
      }
      store_block(acc, kNB, M, N, n0, count, bias, y, y_float);
    }
  }
}
#endif  // KVFLOW_X86_TARGETS

}  // namespace

// AMX where usable. Else vdpbf16ps only on AMD CPUs, which issue it at the zmm FMA rate with twice the products;
// Intel CPUs issue it at half the fp32 FMA rate in flops, where the widened-fp32 kernel is the faster one.
GemmKernel default_gemm_kernel() {
  static const GemmKernel kernel = amx_usable()                          ? GemmKernel::kAmxBf16
                                   : cpu_has_avx512_bf16() && cpu_is_amd() ? GemmKernel::kAvx512Bf16
                                                                            : GemmKernel::kWidenedFp32;
  return kernel;
}

void gemm_with(GemmKernel kernel, const bf16* x, int64_t M, int64_t K, int64_t x_stride, const bf16* w, int64_t N,
               const bf16* bias, bf16* y, float* y_float, int num_threads) {
  if (kernel == GemmKernel::kAmxBf16 || kernel == GemmKernel::kAmxBf16Emulated) {
    amx_gemm_bf16(x, M, K, x_stride, w, N, bias, y, y_float, kernel == GemmKernel::kAmxBf16Emulated, num_threads);
    return;
  }
  for (int64_t m0 = 0; m0 < M; m0 += kMC) {
    const bf16* rows = x + m0 * x_stride;
    const int64_t count = std::min(kMC, M - m0);
    bf16* y_rows = y ? y + m0 * N : nullptr;
    float* y_float_rows = y_float ? y_float + m0 * N : nullptr;
#ifdef KVFLOW_X86_TARGETS
    if (kernel == GemmKernel::kAvx512Bf16) {
      gemm_rows_dpbf16(rows, count, K, x_stride, w, N, bias, y_rows, y_float_rows, num_threads);
      continue;
    }
#endif
    gemm_rows<bf16>(rows, count, K, x_stride, w, N, bias, y_rows, y_float_rows, num_threads);
  }
}

void gemm_float32(const float* x, int64_t M, int64_t K, int64_t x_stride, const float* w, int64_t N, float* y,
                  int num_threads) {
  for (int64_t m0 = 0; m0 < M; m0 += kMC)
    gemm_rows<float>(x + m0 * x_stride, std::min(kMC, M - m0), K, x_stride, w, N, nullptr, y + m0 * N, nullptr,
                     num_threads);
}

#else  // the portable build: the GEMV's scalar loop (the dispatcher only sends M > 8 here on AVX-512 CPUs)

GemmKernel default_gemm_kernel() { return GemmKernel::kWidenedFp32; }

void gemm_with(GemmKernel kernel, const bf16* x, int64_t M, int64_t K, int64_t x_stride, const bf16* w, int64_t N,
               const bf16* bias, bf16* y, float* y_float, int num_threads) {
  (void)kernel;
  gemv<bf16>(x, M, K, x_stride, w, N, bias, y, y_float, num_threads);
}

void gemm_float32(const float* x, int64_t M, int64_t K, int64_t x_stride, const float* w, int64_t N, float* y,
                  int num_threads) {
  gemv<float>(x, M, K, x_stride, w, N, nullptr, y, nullptr, num_threads);
}

#endif

#ifdef KVFLOW_X86_TARGETS
__attribute__((target("avx512f,avx512bf16"))) float avx512_bf16_probe() {
  const __m512bh ones = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1.f), _mm512_set1_ps(1.f));
  return _mm512_reduce_add_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), ones, ones));
}
#else
float avx512_bf16_probe() { throw std::runtime_error("vdpbf16ps needs an x86-64 build"); }
#endif

namespace {
std::atomic<int> chosen_gemm_kernel{-1};  // -1: default_gemm_kernel()
}  // namespace

GemmKernel gemm_kernel() {
  const int chosen = chosen_gemm_kernel.load(std::memory_order_relaxed);
  return chosen < 0 ? default_gemm_kernel() : static_cast<GemmKernel>(chosen);
}

void set_gemm_kernel(GemmKernel kernel) { chosen_gemm_kernel.store(static_cast<int>(kernel)); }

void gemm(const bf16* x, int64_t M, int64_t K, int64_t x_stride, const bf16* w, int64_t N, const bf16* bias, bf16* y,
          float* y_float, int num_threads) {
  gemm_with(gemm_kernel(), x, M, K, x_stride, w, N, bias, y, y_float, num_threads);
}

}  // namespace kvflow
