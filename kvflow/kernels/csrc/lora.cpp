// Batched LoRA deltas on the CPU (punica's bgmv for decode and sgmv for prefill, in one kernel): for every row i
// whose adapter slot s = token_slots[i] is >= 0 and every part p of a packed layer,
//   t = A[s, p * rank .. (p + 1) * rank) @ x[i]                (float32)
//   y[i, part p's rows] = T(float(y[i, part p's rows]) + B[s, part p's rows, :] @ t)   (one rounding)
// Rows with slot -1 are never read from y nor written.
//
// Per call: the rows are grouped per slot (a counting sort, rows ascending within a slot). Shrink: for tiles of up
// to kTileRows rows of one slot and quads of A's rows, each loaded A vector serves every row of the tile, so a slot
// with many rows (prefill) streams A[s] once per tile from cache and one with a few rows (decode) reads it once.
// Expand: for each slot, part and block of 16 output rows, B[s]'s block is widened and transposed once into
// [rank][16] floats and then serves every row of the slot. The threads split shrink items (tile x A row block) and
// expand items (slot x part x output blocks); every item writes its own elements, no sum is split across threads.
//
// Summation orders (batch invariance): t[i, j] = the 16 lanes' fma chains (lane l takes k = l, l + 16, ... in
// ascending order, starting at 0), then a fixed tree over the lanes (reduce16); for bf16 on LoraShrink::kAvx512Bf16
// (AMD CPUs with AVX512_BF16 by default: twice the products per instruction) the lanes run vdpbf16ps instead. The
// delta of output row o is one fma per rank index j in ascending order, starting at 0, then one float add to y and
// one rounding to T. Both depend on `in`, `rank` and the process-wide shrink kind only: not on how many rows share
// a slot, which tile or thread computes a row, or the other rows. The portable build (no AVX-512) follows the same
// orders in scalar code, so its results equal the AVX-512 build's (bf16: with kWidenedFp32) bit for bit.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "common.h"
#include "cpu_features.h"
#include "kernels.h"

namespace kvflow {
namespace {

constexpr int kTileRows = 4;         // rows of one slot sharing each loaded A vector
constexpr int kQuad = 4;             // A rows per shrink micro-kernel call
constexpr int64_t kItemARows = 16;   // A rows per shrink work item
constexpr int64_t kLanes = 16;       // output rows per expand block (one AVX-512 vector of floats)
constexpr int kItemBlocks = 4;       // expand blocks per work item
constexpr int64_t kItemWidth = kItemBlocks * kLanes;  // output rows per expand item

// The rows of each slot: rows_of(s) = rows[starts[s] .. starts[s + 1]), ascending.
struct SlotGroups {
  std::vector<int64_t> starts;
  std::vector<int64_t> rows;
  int64_t count(int64_t slot) const { return starts[slot + 1] - starts[slot]; }
  const int64_t* rows_of(int64_t slot) const { return rows.data() + starts[slot]; }
};

// False (nothing grouped) when a slot lies outside [-1, num_slots).
bool group_rows_by_slot(const int32_t* token_slots, int64_t n, int64_t num_slots, SlotGroups& groups) {
  for (int64_t i = 0; i < n; ++i)
    if (token_slots[i] < -1 || token_slots[i] >= num_slots) return false;
  groups.starts.assign(num_slots + 1, 0);
  for (int64_t i = 0; i < n; ++i)
    if (token_slots[i] >= 0) ++groups.starts[token_slots[i] + 1];
  for (int64_t s = 0; s < num_slots; ++s) groups.starts[s + 1] += groups.starts[s];
  groups.rows.resize(groups.starts[num_slots]);
  std::vector<int64_t> next(groups.starts.begin(), groups.starts.end() - 1);
  for (int64_t i = 0; i < n; ++i)
    if (token_slots[i] >= 0) groups.rows[next[token_slots[i]]++] = i;
  return true;
}

#ifdef KVFLOW_AVX512
// The sum of 16 lanes: lanes l + 8, then l + 4, l + 2 and l + 1 added to lane l (the portable code's tree).
inline float reduce16(__m512 v) {
  const __m256 s8 =
      _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
#endif

#if defined(KVFLOW_AVX512) && defined(KVFLOW_X86_TARGETS)
#define KVFLOW_LORA_DPBF16 1
// shrink_micro for bf16 on vdpbf16ps (LoraShrink::kAvx512Bf16): per step of 32 columns each lane adds the products
// of columns 2l + 1 and then 2l (Intel's pseudo-code: round-to-nearest-even, denormals flushed to zero), then the
// same reduce16. Another order than the widened path's, as fixed.
template <int kRows>
__attribute__((target("avx512bf16"))) void shrink_micro_dpbf16(const bf16* const* x_rows, const bf16* const* a_rows,
                                                              int64_t in, float (*sums)[kQuad]) {
  __m512 acc[kRows][kQuad];
  for (int r = 0; r < kRows; ++r)
    for (int q = 0; q < kQuad; ++q) acc[r][q] = _mm512_setzero_ps();
  for (int64_t k = 0; k < in; k += 2 * kLanes) {
    const int64_t left = in - k;
    const __mmask32 mask = left >= 32 ? ~static_cast<__mmask32>(0) : (static_cast<__mmask32>(1) << left) - 1;
    __m512bh a[kQuad];
    for (int q = 0; q < kQuad; ++q) a[q] = (__m512bh)_mm512_maskz_loadu_epi16(mask, a_rows[q] + k);
    for (int r = 0; r < kRows; ++r) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x_rows[r] + k);
      for (int q = 0; q < kQuad; ++q) acc[r][q] = _mm512_dpbf16_ps(acc[r][q], a[q], xv);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int q = 0; q < kQuad; ++q) sums[r][q] = reduce16(acc[r][q]);
}
#endif

// sums[r][q] = dot(a_rows[q], x_rows[r]) over `in` elements, in the order the header states.
template <typename T, int kRows>
void shrink_micro(const T* const* x_rows, const T* const* a_rows, int64_t in, float (*sums)[kQuad]) {
#ifdef KVFLOW_AVX512
  __m512 acc[kRows][kQuad];
  for (int r = 0; r < kRows; ++r)
    for (int q = 0; q < kQuad; ++q) acc[r][q] = _mm512_setzero_ps();
  for (int64_t k = 0; k < in; k += kLanes) {
    const __mmask16 mask = tail_mask(in - k);
    __m512 a[kQuad];
    for (int q = 0; q < kQuad; ++q) a[q] = load16(a_rows[q] + k, mask);
    for (int r = 0; r < kRows; ++r) {
      const __m512 xv = load16(x_rows[r] + k, mask);
      for (int q = 0; q < kQuad; ++q) acc[r][q] = _mm512_fmadd_ps(a[q], xv, acc[r][q]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int q = 0; q < kQuad; ++q) sums[r][q] = reduce16(acc[r][q]);
#else
  for (int r = 0; r < kRows; ++r)
    for (int q = 0; q < kQuad; ++q) {
      float lanes[kLanes] = {};
      for (int64_t k = 0; k < in; k += kLanes)
        for (int64_t l = 0; l < kLanes; ++l) {
          const bool inside = k + l < in;  // past the end: fma(0, 0, lane), as the masked vector loads
          lanes[l] = std::fma(inside ? to_float<T>(a_rows[q][k + l]) : 0.f,
                              inside ? to_float<T>(x_rows[r][k + l]) : 0.f, lanes[l]);
        }
      for (int64_t width = kLanes / 2; width >= 1; width /= 2)
        for (int64_t l = 0; l < width; ++l) lanes[l] += lanes[l + width];
      sums[r][q] = lanes[0];
    }
#endif
}

// t[row, j] for the tile's rows and A rows [a_begin, a_end) of A[s] (`a_slot`, rows `in` apart); t rows are
// `t_stride` floats apart.
template <typename T, int kRows>
void shrink_tile(LoraShrink shrink, const T* x, int64_t x_stride, const int64_t* tile_rows, const T* a_slot,
                 int64_t in, int64_t a_begin, int64_t a_end, float* t, int64_t t_stride) {
  const T* x_rows[kRows];
  for (int r = 0; r < kRows; ++r) x_rows[r] = x + tile_rows[r] * x_stride;
  float sums[kRows][kQuad];
  for (int64_t j = a_begin; j < a_end; j += kQuad) {
    const int64_t quad = std::min<int64_t>(kQuad, a_end - j);
    const T* a_rows[kQuad];
    for (int q = 0; q < kQuad; ++q) a_rows[q] = a_slot + (j + std::min<int64_t>(q, quad - 1)) * in;
#ifdef KVFLOW_LORA_DPBF16
    if constexpr (sizeof(T) == sizeof(bf16))
      if (shrink == LoraShrink::kAvx512Bf16) {
        shrink_micro_dpbf16<kRows>(x_rows, a_rows, in, sums);
      } else {
        shrink_micro<T, kRows>(x_rows, a_rows, in, sums);
      }
    else
      shrink_micro<T, kRows>(x_rows, a_rows, in, sums);
#else
    (void)shrink;
    shrink_micro<T, kRows>(x_rows, a_rows, in, sums);
#endif
    for (int r = 0; r < kRows; ++r)
      for (int64_t q = 0; q < quad; ++q) t[tile_rows[r] * t_stride + j + q] = sums[r][q];
  }
}

template <typename T>
void shrink_tile_any(int rows, LoraShrink shrink, const T* x, int64_t x_stride, const int64_t* tile_rows,
                     const T* a_slot, int64_t in, int64_t a_begin, int64_t a_end, float* t, int64_t t_stride) {
  switch (rows) {
    case 4: shrink_tile<T, 4>(shrink, x, x_stride, tile_rows, a_slot, in, a_begin, a_end, t, t_stride); break;
    case 3: shrink_tile<T, 3>(shrink, x, x_stride, tile_rows, a_slot, in, a_begin, a_end, t, t_stride); break;
    case 2: shrink_tile<T, 2>(shrink, x, x_stride, tile_rows, a_slot, in, a_begin, a_end, t, t_stride); break;
    default: shrink_tile<T, 1>(shrink, x, x_stride, tile_rows, a_slot, in, a_begin, a_end, t, t_stride); break;
  }
}

// The item's B rows [o_begin, o_begin + width) (width <= kItemWidth, `b_rows` points at row o_begin, rows `rank`
// apart) as floats transposed: bt[j * kItemWidth + l] = B[o_begin + l, j], 0 for l >= width.
template <typename T>
void transpose_item(const T* b_rows, int64_t width, int64_t rank, float* bt) {
#ifdef KVFLOW_AVX512
  for (int64_t block = 0; block < kItemBlocks; ++block) {
    const int64_t lanes = std::clamp<int64_t>(width - block * kLanes, 0, kLanes);
    for (int64_t j0 = 0; j0 < rank; j0 += kLanes) {
      const int64_t columns = std::min(kLanes, rank - j0);
      __m512 v[kLanes];
      for (int64_t l = 0; l < kLanes; ++l)
        v[l] = l < lanes ? load16(b_rows + (block * kLanes + l) * rank + j0, tail_mask(columns)) : _mm512_setzero_ps();
      transpose16x16(v);
      for (int64_t c = 0; c < columns; ++c) _mm512_storeu_ps(bt + (j0 + c) * kItemWidth + block * kLanes, v[c]);
    }
  }
#else
  for (int64_t j = 0; j < rank; ++j)
    for (int64_t l = 0; l < kItemWidth; ++l)
      bt[j * kItemWidth + l] = l < width ? to_float<T>(b_rows[l * rank + j]) : 0.f;
#endif
}

// For kRows rows of one slot: y[row, o_begin + l] = T(float(y) + sum over j ascending of bt[j][l] * t_part[j])
// for l < width (t_part: the row's t at the part's offset).
template <typename T, int kRows>
void expand_tile(const float* bt, int64_t width, int64_t rank, const int64_t* tile_rows, const float* t,
                 int64_t t_stride, int64_t t_offset, T* y, int64_t y_stride, int64_t o_begin) {
#ifdef KVFLOW_AVX512
  __m512 acc[kRows][kItemBlocks];
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kItemBlocks; ++b) acc[r][b] = _mm512_setzero_ps();
  const float* t_parts[kRows];
  for (int r = 0; r < kRows; ++r) t_parts[r] = t + tile_rows[r] * t_stride + t_offset;
  for (int64_t j = 0; j < rank; ++j) {
    __m512 columns[kItemBlocks];
    for (int b = 0; b < kItemBlocks; ++b) columns[b] = _mm512_loadu_ps(bt + j * kItemWidth + b * kLanes);
    for (int r = 0; r < kRows; ++r) {
      const __m512 factor = _mm512_set1_ps(t_parts[r][j]);
      for (int b = 0; b < kItemBlocks; ++b) acc[r][b] = _mm512_fmadd_ps(columns[b], factor, acc[r][b]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    T* y_row = y + tile_rows[r] * y_stride + o_begin;
    for (int b = 0; b < kItemBlocks; ++b) {
      const __mmask16 mask = tail_mask(std::clamp<int64_t>(width - b * kLanes, 0, kLanes));
      store16(y_row + b * kLanes, _mm512_add_ps(load16(y_row + b * kLanes, mask), acc[r][b]), mask);
    }
  }
#else
  for (int r = 0; r < kRows; ++r) {
    const float* t_part = t + tile_rows[r] * t_stride + t_offset;
    float acc[kItemWidth] = {};
    for (int64_t j = 0; j < rank; ++j)
      for (int64_t l = 0; l < kItemWidth; ++l) acc[l] = std::fma(bt[j * kItemWidth + l], t_part[j], acc[l]);
    T* y_row = y + tile_rows[r] * y_stride + o_begin;
    for (int64_t l = 0; l < width; ++l) y_row[l] = from_float<T>(to_float<T>(y_row[l]) + acc[l]);
  }
#endif
}

template <typename T>
void expand_tile_any(int rows, const float* bt, int64_t width, int64_t rank, const int64_t* tile_rows, const float* t,
                     int64_t t_stride, int64_t t_offset, T* y, int64_t y_stride, int64_t o_begin) {
  switch (rows) {
    case 4: expand_tile<T, 4>(bt, width, rank, tile_rows, t, t_stride, t_offset, y, y_stride, o_begin); break;
    case 3: expand_tile<T, 3>(bt, width, rank, tile_rows, t, t_stride, t_offset, y, y_stride, o_begin); break;
    case 2: expand_tile<T, 2>(bt, width, rank, tile_rows, t, t_stride, t_offset, y, y_stride, o_begin); break;
    default: expand_tile<T, 1>(bt, width, rank, tile_rows, t, t_stride, t_offset, y, y_stride, o_begin); break;
  }
}

// Below this many multiply-adds (shrink and expand together) the call runs on the calling thread: waking the
// OpenMP team from the engine-core thread costs ~55 us, where a one-row delta computes in 5-13 us and a 64-row
// decode step's in 40-150 us on the built-in model's shapes (one thread measured faster than two there, in the
// engine: benchmarks/lora.py). Rows never split a sum across threads either way, so results do not change.
constexpr int64_t kParallelMacs = int64_t{1} << 22;

struct ShrinkItem {
  int64_t slot, first, count, a_begin;  // rows_of(slot)[first .. first + count), A rows [a_begin, +kItemARows)
};
struct ExpandItem {
  int64_t slot, part, o_begin, o_end;  // output rows [o_begin, o_end) inside part `part`
};

}  // namespace

template <typename T>
bool lora_add(T* y, int64_t y_stride, const T* x, int64_t x_stride, int64_t n, int64_t in, int64_t out,
              const T* lora_a, const T* lora_b, int64_t num_slots, int64_t rank, const int32_t* token_slots,
              const int64_t* part_offsets, int64_t num_parts, LoraShrink shrink, int num_threads) {
  SlotGroups groups;
  if (!group_rows_by_slot(token_slots, n, num_slots, groups)) return false;
  if (groups.rows.empty() || rank == 0) return true;
  const int64_t a_rows = num_parts * rank;
  std::vector<float> t(static_cast<size_t>(n * a_rows));
  const int64_t num_rows = static_cast<int64_t>(groups.rows.size());
  const bool parallel = num_rows * (a_rows * in + rank * out) >= kParallelMacs;

  std::vector<ShrinkItem> shrink_items;
  for (int64_t s = 0; s < num_slots; ++s)
    for (int64_t first = 0; first < groups.count(s); first += kTileRows)
      for (int64_t a_begin = 0; a_begin < a_rows; a_begin += kItemARows)
        shrink_items.push_back({s, first, std::min<int64_t>(kTileRows, groups.count(s) - first), a_begin});
  const int64_t num_shrink = static_cast<int64_t>(shrink_items.size());
  std::vector<ExpandItem> expand_items;
  for (int64_t s = 0; s < num_slots; ++s) {
    if (groups.count(s) == 0) continue;
    for (int64_t p = 0; p < num_parts; ++p)
      for (int64_t o = part_offsets[p]; o < part_offsets[p + 1]; o += kItemWidth)
        expand_items.push_back({s, p, o, std::min(part_offsets[p + 1], o + kItemWidth)});
  }
  const int64_t num_expand = static_cast<int64_t>(expand_items.size());
  // One parallel region (one team wake-up): every shrink item, the loop's barrier, then every expand item.
#pragma omp parallel num_threads(num_threads) if (parallel)
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < num_shrink; ++i) {
      const ShrinkItem& item = shrink_items[i];
      shrink_tile_any<T>(static_cast<int>(item.count), shrink, x, x_stride, groups.rows_of(item.slot) + item.first,
                         lora_a + item.slot * a_rows * in, in, item.a_begin,
                         std::min(a_rows, item.a_begin + kItemARows), t.data(), a_rows);
    }
    std::vector<float> bt(static_cast<size_t>(rank * kItemWidth));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < num_expand; ++i) {
      const ExpandItem& item = expand_items[i];
      transpose_item<T>(lora_b + (item.slot * out + item.o_begin) * rank, item.o_end - item.o_begin, rank, bt.data());
      const int64_t* rows = groups.rows_of(item.slot);
      for (int64_t first = 0; first < groups.count(item.slot); first += kTileRows)
        expand_tile_any<T>(static_cast<int>(std::min<int64_t>(kTileRows, groups.count(item.slot) - first)), bt.data(),
                           item.o_end - item.o_begin, rank, rows + first, t.data(), a_rows, item.part * rank, y,
                           y_stride, item.o_begin);
    }
  }
  return true;
}

// vdpbf16ps where it issues at the zmm FMA rate with twice the products (AMD CPUs with AVX512_BF16: the same
// choice as default_gemm_kernel's), on AVX-512 builds; else the widened fp32 FMAs.
LoraShrink default_lora_shrink() {
#ifdef KVFLOW_LORA_DPBF16
  static const LoraShrink shrink =
      cpu_has_avx512_bf16() && cpu_is_amd() ? LoraShrink::kAvx512Bf16 : LoraShrink::kWidenedFp32;
  return shrink;
#else
  return LoraShrink::kWidenedFp32;
#endif
}

bool lora_shrink_available(LoraShrink shrink) {
#ifdef KVFLOW_LORA_DPBF16
  return true;
#else
  return shrink == LoraShrink::kWidenedFp32;
#endif
}

template bool lora_add<float>(float*, int64_t, const float*, int64_t, int64_t, int64_t, int64_t, const float*,
                              const float*, int64_t, int64_t, const int32_t*, const int64_t*, int64_t, LoraShrink,
                              int);
template bool lora_add<bf16>(bf16*, int64_t, const bf16*, int64_t, int64_t, int64_t, int64_t, const bf16*,
                             const bf16*, int64_t, int64_t, const int32_t*, const int64_t*, int64_t, LoraShrink,
                             int);

}  // namespace kvflow
