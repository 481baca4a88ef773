// Paged attention over the KV cache: K/V read in place through the block table (no gather), online softmax in
// fp32, optional logit soft-capping. One work item is (row, kv head, tile of the row's consecutive query tokens):
// the tile's query vectors (tokens x the kv head's query-head group, GQA) share each loaded K/V row, and the item
// reads only the keys some vector may see, from the first token's window start (sliding window) to the last
// token's position, so a sliding layer costs O(window) per token whatever the sequence length.
#include <omp.h>

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#include "common.h"
#include "kernels.h"

namespace kvflow {
namespace {

constexpr int kMaxVectors = 32;  // query vectors per item; bindings.cpp refuses query groups per KV head above it

// What every item of one call shares.
struct AttentionShape {
  int64_t num_blocks, block_size, head_dim, padded_dim, group;
  float scale, softcap;  // softcap 0: none
  int64_t window;        // 0: none
};

// tanh(x / cap) * cap for 16 scores (cap > 0), through exp(-2|x| / cap) so no term cancels catastrophically.
#ifdef KVFLOW_AVX512
inline __m512 softcap16(__m512 x, float cap) {
  const __m512 scaled = _mm512_mul_ps(x, _mm512_set1_ps(1.f / cap));
  const __m512 magnitude = _mm512_abs_ps(scaled);
  const __m512 decay = exp16(_mm512_mul_ps(magnitude, _mm512_set1_ps(-2.f)));
  const __m512 one = _mm512_set1_ps(1.f);
  __m512 result = _mm512_div_ps(_mm512_sub_ps(one, decay), _mm512_add_ps(one, decay));
  // restore the sign: copy x's sign bit onto the non-negative tanh(|x|)
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(scaled), _mm512_set1_epi32(0x80000000));
  result = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(result), sign));
  return _mm512_mul_ps(result, _mm512_set1_ps(cap));
}
#endif

#ifdef KVFLOW_AVX512
constexpr int kScoreKeys = 4;  // keys per pass of one query vector: independent accumulator chains

// Keys j0 .. j0 + kScoreKeys - 1 clamped to last - 1 (a repeated key's score is computed and discarded).
template <typename T>
inline void score_key_rows(const T* keys, int64_t j0, int64_t last, int64_t head_dim, const T* rows[kScoreKeys]) {
  for (int i = 0; i < kScoreKeys; ++i) rows[i] = keys + std::min<int64_t>(j0 + i, last - 1) * head_dim;
}

// The totals of four accumulators times `factor` into out[0 .. count): one shuffle tree for all four instead of four
// _mm512_reduce_add_ps (13 shuffles and adds against ~28). It adds in _mm512_reduce_add_ps's order (the 256-bit
// halves, then the 128-bit halves, then elements {0,1} + {2,3}, then the two), so each total is bitwise the same.
inline void reduce_add4(const __m512 sums[kScoreKeys], float factor, float* out, int64_t count) {
  static_assert(kScoreKeys == 4, "reduce_add4 folds four accumulators");
  // lanes (128-bit): [s0.l0 + s0.l2, s0.l1 + s0.l3, s1.l0 + s1.l2, s1.l1 + s1.l3], the same of s2, s3
  const __m512 t01 =
      _mm512_add_ps(_mm512_shuffle_f32x4(sums[0], sums[1], 0x44), _mm512_shuffle_f32x4(sums[0], sums[1], 0xEE));
  const __m512 t23 =
      _mm512_add_ps(_mm512_shuffle_f32x4(sums[2], sums[3], 0x44), _mm512_shuffle_f32x4(sums[2], sums[3], 0xEE));
  // lane i: accumulator i's four partial sums
  const __m512 lanes = _mm512_add_ps(_mm512_shuffle_f32x4(t01, t23, 0x88), _mm512_shuffle_f32x4(t01, t23, 0xDD));
  const __m512 pairs = _mm512_add_ps(lanes, _mm512_permute_ps(lanes, 0x4E));  // {e0 + e2, e1 + e3} per lane
  const __m512 totals = _mm512_add_ps(pairs, _mm512_permute_ps(pairs, 0xB1));  // element 0 of lane i: total i
  alignas(64) float spilled[16];
  _mm512_store_ps(spilled, _mm512_mul_ps(totals, _mm512_set1_ps(factor)));
  for (int64_t i = 0; i < count; ++i) out[i] = spilled[4 * i];
}
#endif

// Scores q.k of keys [first, last) of one block against `vectors` query vectors into scores[v * block_size + j],
// then soft-capped. bf16 with AVX512_BF16: the raw bf16 queries (q_bf16, rows of q_bf16_stride, zero-padded to
// a multiple of 32) times the keys in pairs, exact products summed in fp32, times scale; otherwise q_buffer
// (fp32, pre-scaled, rows of padded_dim zero-padded) times the keys widened to fp32.
template <typename T>
void block_scores(const T* keys, const float* q_buffer, const bf16* q_bf16, int64_t q_bf16_stride, int64_t vectors,
                  int64_t first, int64_t last, const AttentionShape& s, float* scores) {
#ifdef KVFLOW_AVX512
  for (int64_t v = 0; v < vectors; ++v) {
    float* row = scores + v * s.block_size;
    for (int64_t j0 = first; j0 < last; j0 += kScoreKeys) {
      const T* key_rows[kScoreKeys];
      score_key_rows(keys, j0, last, s.head_dim, key_rows);
      __m512 sums[kScoreKeys];
      for (int i = 0; i < kScoreKeys; ++i) sums[i] = _mm512_setzero_ps();
      float factor = 1.f;
#ifdef __AVX512BF16__
      if constexpr (std::is_same_v<T, bf16>) {
        const bf16* q = q_bf16 + v * q_bf16_stride;
        for (int64_t d = 0; d < s.head_dim; d += 32) {
          const int64_t left = s.head_dim - d;
          const __mmask32 mask = left >= 32 ? 0xffffffffu : (1u << left) - 1u;
          const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + d);
          for (int i = 0; i < kScoreKeys; ++i)
            sums[i] = _mm512_dpbf16_ps(sums[i], qv, (__m512bh)_mm512_maskz_loadu_epi16(mask, key_rows[i] + d));
        }
        factor = s.scale;
      } else
#endif
      {
        const float* q = q_buffer + v * s.padded_dim;
        for (int64_t d = 0; d < s.head_dim; d += 16) {
          const __mmask16 mask = tail_mask(s.head_dim - d);
          const __m512 qv = _mm512_loadu_ps(q + d);
          for (int i = 0; i < kScoreKeys; ++i) sums[i] = _mm512_fmadd_ps(qv, load16(key_rows[i] + d, mask), sums[i]);
        }
      }
      reduce_add4(sums, factor, row + j0, std::min<int64_t>(kScoreKeys, last - j0));
    }
  }
#else
  (void)q_bf16;
  (void)q_bf16_stride;
  for (int64_t j = first; j < last; ++j) {
    const T* key = keys + j * s.head_dim;
    for (int64_t v = 0; v < vectors; ++v) {
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t d = 0; d < s.head_dim; ++d) sum += q_buffer[v * s.padded_dim + d] * to_float<T>(key[d]);
      scores[v * s.block_size + j] = sum;
    }
  }
#endif
  if (s.softcap <= 0.f) return;
  for (int64_t v = 0; v < vectors; ++v) {
    float* row = scores + v * s.block_size;
#ifdef KVFLOW_AVX512
    for (int64_t j = first; j < last; j += 16) {
      const __mmask16 mask = tail_mask(last - j);
      _mm512_mask_storeu_ps(row + j, mask, softcap16(_mm512_maskz_loadu_ps(mask, row + j), s.softcap));
    }
#else
    for (int64_t j = first; j < last; ++j) row[j] = std::tanh(row[j] / s.softcap) * s.softcap;
#endif
  }
}

#ifdef KVFLOW_AVX512
constexpr int64_t kPvVectors = 8;

// acc[i * acc_stride .. + 16] += sum_j p[i * p_stride + j] * values[j * value_stride .. + 16] for i < N, j in
// [first, last): the N accumulators stay in registers across the keys and each loaded V slice serves all of them.
template <int N, typename T>
inline void accumulate_values_n(const float* p, int64_t p_stride, int64_t first, int64_t last, const T* values,
                                int64_t value_stride, __mmask16 mask, float* acc, int64_t acc_stride) {
  __m512 sums[N];
  for (int i = 0; i < N; ++i) sums[i] = _mm512_loadu_ps(acc + i * acc_stride);
  for (int64_t j = first; j < last; ++j) {
    const __m512 value = load16(values + j * value_stride, mask);
    for (int i = 0; i < N; ++i) sums[i] = _mm512_fmadd_ps(_mm512_set1_ps(p[i * p_stride + j]), value, sums[i]);
  }
  for (int i = 0; i < N; ++i) _mm512_storeu_ps(acc + i * acc_stride, sums[i]);
}

template <typename T>
inline void accumulate_values(int64_t count, const float* p, int64_t p_stride, int64_t first, int64_t last,
                              const T* values, int64_t value_stride, __mmask16 mask, float* acc, int64_t acc_stride) {
  switch (count) {
#define KVFLOW_CASE(n) \
  case n:              \
    return accumulate_values_n<n, T>(p, p_stride, first, last, values, value_stride, mask, acc, acc_stride);
    KVFLOW_CASE(1) KVFLOW_CASE(2) KVFLOW_CASE(3) KVFLOW_CASE(4) KVFLOW_CASE(5) KVFLOW_CASE(6) KVFLOW_CASE(7)
    KVFLOW_CASE(8)
#undef KVFLOW_CASE
  }
}
#endif

struct LaneBuffers;  // the key-lane path's buffers (below, on AVX512_BF16 builds)

#if defined(KVFLOW_AVX512) && defined(__AVX512BF16__)
// bfloat16 items with keys across the vector lanes: a chunk of up to 16 keys of one block is transposed once per
// item (each lane one key, each vector one pair of head dims), then every query vector's 16 scores are one register
// of vdpbf16ps with that vector's pair of query values broadcast: no horizontal sums, and the softmax folds the
// chunk as one vector. A lane's score is its key's sum over the pairs in order whatever the other lanes hold, and
// lane j is block position 16c + j, so a token's result depends only on its own query, keys and position (not on
// its batch, tile or row).
#define KVFLOW_KEY_LANES 1
constexpr int64_t kLaneKeys = 16;

// One thread's buffers for the key-lane path.
struct LaneBuffers {
  uint32_t* key_pairs;    // [pairs rounded up to 16][kLaneKeys]: the chunk's keys, pair p of key j at p * 16 + j
  uint32_t* query_pairs;  // [ceil(head_dim / 2)][kMaxVectors]: pair p of the item's vector v at p * 32 + v
  float* probs;           // [kMaxVectors][kLaneKeys]: the chunk's probabilities, vector v's at v * 16
};

// keys[0 .. count) (rows of head_dim bf16) into key_pairs[p * 16 + j] = head dims 2p, 2p + 1 of key j, for
// p < ceil(head_dim / 2); lanes j >= count and dims past head_dim are zero.
inline void transpose_key_pairs(const bf16* keys, int64_t count, int64_t head_dim, uint32_t* key_pairs) {
  const int64_t num_pairs = (head_dim + 1) / 2;
  for (int64_t d = 0; d < head_dim; d += 32) {
    const int64_t left = head_dim - d;
    const __mmask32 mask = left >= 32 ? 0xffffffffu : (1u << left) - 1u;
    __m512 rows[16];  // pairs of bf16 as 32-bit lanes (float only as the transpose's register type)
    for (int64_t j = 0; j < kLaneKeys; ++j)
      rows[j] = j < count ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(mask, keys + j * head_dim + d))
                          : _mm512_setzero_ps();
    transpose16x16(rows);
    const int64_t first_pair = d / 2;
    for (int64_t p = 0; p < 16 && first_pair + p < num_pairs; ++p)
      _mm512_storeu_si512(key_pairs + (first_pair + p) * kLaneKeys, _mm512_castps_si512(rows[p]));
  }
}

// sums[i] lane j = query vector i . key j, for N vectors whose pairs start at query_pairs (column i).
template <int N>
inline void lane_scores_n(const uint32_t* key_pairs, int64_t num_pairs, const uint32_t* query_pairs, __m512 sums[]) {
  for (int i = 0; i < N; ++i) sums[i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < num_pairs; ++p) {
    const __m512bh keys = (__m512bh)_mm512_loadu_si512(key_pairs + p * kLaneKeys);
    const uint32_t* q = query_pairs + p * kMaxVectors;
    for (int i = 0; i < N; ++i)
      sums[i] = _mm512_dpbf16_ps(sums[i], keys, (__m512bh)_mm512_set1_epi32(static_cast<int>(q[i])));
  }
}

inline void lane_scores(int64_t count, const uint32_t* key_pairs, int64_t num_pairs, const uint32_t* query_pairs,
                        __m512 sums[]) {
  switch (count) {
#define KVFLOW_CASE(n) \
  case n:              \
    return lane_scores_n<n>(key_pairs, num_pairs, query_pairs, sums);
    KVFLOW_CASE(1) KVFLOW_CASE(2) KVFLOW_CASE(3) KVFLOW_CASE(4) KVFLOW_CASE(5) KVFLOW_CASE(6) KVFLOW_CASE(7)
    KVFLOW_CASE(8)
#undef KVFLOW_CASE
  }
}

// As accumulate_values: the probabilities' rows are kLaneKeys apart (one 16-key chunk's lanes a row).
inline void accumulate_lanes(int64_t count, const float* probs, int64_t first, int64_t last, const bf16* values,
                             int64_t value_stride, __mmask16 mask, float* acc, int64_t acc_stride) {
  switch (count) {
#define KVFLOW_CASE(n) \
  case n:              \
    return accumulate_values_n<n>(probs, kLaneKeys, first, last, values, value_stride, mask, acc, acc_stride);
    KVFLOW_CASE(1) KVFLOW_CASE(2) KVFLOW_CASE(3) KVFLOW_CASE(4) KVFLOW_CASE(5) KVFLOW_CASE(6) KVFLOW_CASE(7)
    KVFLOW_CASE(8)
#undef KVFLOW_CASE
  }
}

// Folds one chunk's scores into the vector's running max and sum: lanes outside `visible` get probability 0; all 16
// probabilities go to probs; returns the factor the vector's accumulator must be scaled by (1 when no lane is
// visible).
inline float fold_lanes(__m512 scores, __mmask16 visible, float* probs, float& running_max, float& running_sum) {
  if (visible == 0) {
    _mm512_storeu_ps(probs, _mm512_setzero_ps());
    return 1.f;
  }
  const float chunk_max = std::max(running_max, _mm512_mask_reduce_max_ps(visible, scores));
  const __m512 p = _mm512_maskz_mov_ps(visible, exp16(_mm512_sub_ps(scores, _mm512_set1_ps(chunk_max))));
  _mm512_storeu_ps(probs, p);
  // exp(0) is 1 exactly: most chunks leave the max where it was
  const float correction = chunk_max == running_max ? 1.f : std::exp(running_max - chunk_max);
  running_sum = running_sum * correction + _mm512_reduce_add_ps(p);
  running_max = chunk_max;
  return correction;
}
#endif

// Folds one block's scores (keys [first, last) at positions base + j) into vector v's running max and sum:
// keys outside [lo, hi) get probability 0; scores become probabilities relative to the new running max; returns
// the factor the vector's accumulator must be scaled by (1 when the block holds no visible key).
inline float fold_block(float* row, int64_t first, int64_t last, int64_t base, int64_t lo, int64_t hi,
                        float& running_max, float& running_sum) {
  const int64_t visible_first = std::max(first, lo - base), visible_last = std::min(last, hi - base);
  if (visible_first >= visible_last) {
    for (int64_t j = first; j < last; ++j) row[j] = 0.f;
    return 1.f;
  }
  for (int64_t j = first; j < visible_first; ++j) row[j] = 0.f;
  for (int64_t j = visible_last; j < last; ++j) row[j] = 0.f;
  float block_max = running_max;
  for (int64_t j = visible_first; j < visible_last; ++j) block_max = std::max(block_max, row[j]);
  float block_sum = 0.f;
#ifdef KVFLOW_AVX512
  __m512 sums = _mm512_setzero_ps();
  for (int64_t j = visible_first; j < visible_last; j += 16) {
    const __mmask16 mask = tail_mask(visible_last - j);
    __m512 p = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, row + j), _mm512_set1_ps(block_max)));
    p = _mm512_maskz_mov_ps(mask, p);
    _mm512_mask_storeu_ps(row + j, mask, p);
    sums = _mm512_add_ps(sums, p);
  }
  block_sum = _mm512_reduce_add_ps(sums);
#else
  for (int64_t j = visible_first; j < visible_last; ++j) {
    row[j] = std::exp(row[j] - block_max);
    block_sum += row[j];
  }
#endif
  const float correction = std::exp(running_max - block_max);
  running_sum = running_sum * correction + block_sum;
  running_max = block_max;
  return correction;
}

#ifdef KVFLOW_KEY_LANES
// One block of a bfloat16 item (block positions [first, last) at positions base + j; vector v sees [lo[v], hi[v])),
// 16 block positions at a time (lane j: position 16c + j): the chunk's keys transposed, every vector's scores and
// softmax fold, then P.V. `lanes.query_pairs` holds the item's query vectors.
inline void attend_chunks(const bf16* keys, const bf16* values, int64_t vectors, int64_t first, int64_t last,
                          int64_t base, const int64_t* lo, const int64_t* hi, const AttentionShape& s,
                          const LaneBuffers& lanes, float* running_max, float* running_sum, float* acc) {
  const int64_t num_pairs = (s.head_dim + 1) / 2, padded_dim = s.padded_dim;
  for (int64_t c0 = first / kLaneKeys * kLaneKeys; c0 < last; c0 += kLaneKeys) {
    const int64_t count = std::min(kLaneKeys, s.block_size - c0);
    const int64_t chunk_first = std::max(first, c0) - c0, chunk_last = std::min(last, c0 + count) - c0;
    transpose_key_pairs(keys + c0 * s.head_dim, count, s.head_dim, lanes.key_pairs);
    for (int64_t v0 = 0; v0 < vectors; v0 += kPvVectors) {
      const int64_t group = std::min(kPvVectors, vectors - v0);
      __m512 sums[kPvVectors];
      lane_scores(group, lanes.key_pairs, num_pairs, lanes.query_pairs + v0, sums);
      for (int64_t i = 0; i < group; ++i) {
        const int64_t v = v0 + i;
        __m512 chunk = _mm512_mul_ps(sums[i], _mm512_set1_ps(s.scale));
        if (s.softcap > 0.f) chunk = softcap16(chunk, s.softcap);
        const int64_t visible_first = std::max(chunk_first, lo[v] - base - c0);
        const int64_t visible_last = std::min(chunk_last, hi[v] - base - c0);
        const __mmask16 visible =
            visible_first < visible_last ? static_cast<__mmask16>(tail_mask(visible_last) & ~tail_mask(visible_first))
                                         : static_cast<__mmask16>(0);
        const float correction =
            fold_lanes(chunk, visible, lanes.probs + v * kLaneKeys, running_max[v], running_sum[v]);
        if (correction != 1.f)
          for (int64_t d = 0; d < padded_dim; ++d) acc[v * padded_dim + d] *= correction;
      }
    }
    const bf16* chunk_values = values + c0 * s.head_dim;
    for (int64_t d = 0; d < s.head_dim; d += 16)
      for (int64_t v0 = 0; v0 < vectors; v0 += kPvVectors)
        accumulate_lanes(std::min(kPvVectors, vectors - v0), lanes.probs + v0 * kLaneKeys, chunk_first, chunk_last,
                         chunk_values + d, s.head_dim, tail_mask(s.head_dim - d), acc + v0 * padded_dim + d,
                         padded_dim);
  }
}
#endif

// Asks for data[0 .. count) in the cache, a line at a time.
template <typename T>
inline void prefetch_elements(const T* data, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(data);
  for (int64_t offset = 0; offset < count * static_cast<int64_t>(sizeof(T)); offset += 64)
    __builtin_prefetch(bytes + offset);
}

// One item: `tokens` consecutive query tokens of one row (token t at position first_position + t, its query at
// query + t * q_token_stride, its output at out + t * out_token_stride) against kv head `kv_head`. Vector
// v = t * group + g is query head kv_head * group + g of token t; it sees keys [lo_t, first_position + t + 1).
template <typename T>
void attend_tile(const T* query, int64_t q_token_stride, int64_t q_head_stride, int64_t first_position,
                 int64_t tokens, const T* key_cache, const T* value_cache, const int32_t* table, int64_t kv_head,
                 const AttentionShape& s, T* out, int64_t out_token_stride, float* q_buffer, bf16* q_bf16,
                 float* acc, float* scores, const LaneBuffers* lanes) {
  (void)lanes;  // only the key-lane path reads it
  const int64_t q_bf16_stride = (s.head_dim + 31) / 32 * 32;
  const int64_t vectors = tokens * s.group, padded_dim = s.padded_dim, block_size = s.block_size;
  float running_max[kMaxVectors], running_sum[kMaxVectors];
  int64_t lo[kMaxVectors], hi[kMaxVectors];
  for (int64_t v = 0; v < vectors; ++v) {
    const int64_t t = v / s.group, g = v % s.group;
    const T* q = query + t * q_token_stride + (kv_head * s.group + g) * q_head_stride;
    for (int64_t d = 0; d < padded_dim; ++d) {
      q_buffer[v * padded_dim + d] = d < s.head_dim ? to_float<T>(q[d]) * s.scale : 0.f;
      acc[v * padded_dim + d] = 0.f;
    }
    if constexpr (std::is_same_v<T, bf16>)
      for (int64_t d = 0; d < q_bf16_stride; ++d) q_bf16[v * q_bf16_stride + d] = d < s.head_dim ? q[d] : bf16{0};
#ifdef KVFLOW_KEY_LANES
    if constexpr (std::is_same_v<T, bf16>)
      for (int64_t p = 0; p < (s.head_dim + 1) / 2; ++p) {
        const uint32_t high = 2 * p + 1 < s.head_dim ? q[2 * p + 1] : 0;
        lanes->query_pairs[p * kMaxVectors + v] = q[2 * p] | high << 16;
      }
#endif
    running_max[v] = -std::numeric_limits<float>::infinity();
    running_sum[v] = 0.f;
    hi[v] = first_position + t + 1;
    lo[v] = s.window > 0 ? std::max<int64_t>(0, hi[v] - s.window) : 0;
  }
  const int64_t start = lo[0], end = hi[vectors - 1];
  const int64_t block_elements = block_size * s.head_dim;
  for (int64_t b = start / block_size; b * block_size < end; ++b) {
    const int64_t base = b * block_size;
    const int64_t first = std::max(start, base) - base, last = std::min(end - base, block_size);
    const int64_t offset = (kv_head * s.num_blocks + table[b]) * block_elements;
    if (base + block_size < end) {  // the next block's K and V, while this one is attended
      const int64_t next = (kv_head * s.num_blocks + table[b + 1]) * block_elements;
      prefetch_elements(key_cache + next, block_elements);
      prefetch_elements(value_cache + next, block_elements);
    }
    const T* values = value_cache + offset;
#ifdef KVFLOW_KEY_LANES
    if constexpr (std::is_same_v<T, bf16>) {
      attend_chunks(key_cache + offset, values, vectors, first, last, base, lo, hi, s, *lanes, running_max,
                    running_sum, acc);
      continue;
    }
#endif
    block_scores<T>(key_cache + offset, q_buffer, q_bf16, q_bf16_stride, vectors, first, last, s, scores);
    for (int64_t v = 0; v < vectors; ++v) {
      const float correction =
          fold_block(scores + v * block_size, first, last, base, lo[v], hi[v], running_max[v], running_sum[v]);
      if (correction != 1.f)
        for (int64_t d = 0; d < padded_dim; ++d) acc[v * padded_dim + d] *= correction;
    }
#ifdef KVFLOW_AVX512
    // acc[v] += sum_j p[v, j] * V[j]: one 16-wide slice of the head for up to kPvVectors vectors at a time
    for (int64_t d = 0; d < s.head_dim; d += 16)
      for (int64_t v0 = 0; v0 < vectors; v0 += kPvVectors)
        accumulate_values(std::min(kPvVectors, vectors - v0), scores + v0 * block_size, block_size, first, last,
                          values + d, s.head_dim, tail_mask(s.head_dim - d), acc + v0 * padded_dim + d, padded_dim);
#else
    for (int64_t j = first; j < last; ++j) {
      const T* value = values + j * s.head_dim;
      for (int64_t v = 0; v < vectors; ++v) {
        const float p = scores[v * block_size + j];
        for (int64_t d = 0; d < s.head_dim; ++d) acc[v * padded_dim + d] += p * to_float<T>(value[d]);
      }
    }
#endif
  }
  for (int64_t v = 0; v < vectors; ++v) {
    const int64_t t = v / s.group, g = v % s.group;
    const float inverse = 1.f / running_sum[v];
    T* o = out + t * out_token_stride + (kv_head * s.group + g) * s.head_dim;
    for (int64_t d = 0; d < s.head_dim; ++d) o[d] = from_float<T>(acc[v * padded_dim + d] * inverse);
  }
}

}  // namespace

template <typename T>
void paged_attention(const T* query, int64_t q_token_stride, int64_t q_head_stride, const T* key_cache,
                     const T* value_cache, int64_t num_blocks, int64_t block_size, const int32_t* block_tables,
                     int64_t table_stride, const int32_t* seq_lens, const int64_t* token_start,
                     const int32_t* query_lens, int64_t rows, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_dim, float scale, int64_t window, float softcap, T* out, int num_threads) {
  const int64_t group = num_heads / num_kv_heads;
  const AttentionShape shape{num_blocks, block_size, head_dim, (head_dim + 15) / 16 * 16, group, scale, softcap,
                             window};
  const int64_t tile_tokens = std::max<int64_t>(1, kMaxVectors / group);
  // (row, first query token of the tile) per tile; each tile is num_kv_heads items
  std::vector<std::pair<int64_t, int64_t>> tiles;
  tiles.reserve(rows);
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t count = query_lens ? query_lens[row] : 1;
    for (int64_t first = 0; first < count; first += tile_tokens) tiles.emplace_back(row, first);
  }
  const int64_t items = static_cast<int64_t>(tiles.size()) * num_kv_heads;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, items)));
#pragma omp parallel num_threads(threads)
  {
    const int64_t vectors = tile_tokens * group;
    std::vector<float> q_buffer(vectors * shape.padded_dim), acc(vectors * shape.padded_dim),
        scores(vectors * block_size);
    std::vector<bf16> q_bf16(vectors * ((head_dim + 31) / 32 * 32));
#ifdef KVFLOW_KEY_LANES
    std::vector<uint32_t> key_pairs((head_dim + 31) / 32 * 16 * kLaneKeys), query_pairs((head_dim + 1) / 2 * kMaxVectors);
    std::vector<float> probs(kMaxVectors * kLaneKeys);
    const LaneBuffers lane_buffers{key_pairs.data(), query_pairs.data(), probs.data()};
    const LaneBuffers* lanes = &lane_buffers;
#else
    const LaneBuffers* lanes = nullptr;
#endif
    // later tiles of a row see more keys: dynamic scheduling balances them
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const auto [row, first] = tiles[item / num_kv_heads];
      const int64_t kv_head = item % num_kv_heads;
      const int64_t count = query_lens ? query_lens[row] : 1;
      const int64_t tokens = std::min(tile_tokens, count - first);
      const int64_t token = token_start[row] + first;
      attend_tile<T>(query + token * q_token_stride, q_token_stride, q_head_stride, seq_lens[row] - count + first,
                     tokens, key_cache, value_cache, block_tables + row * table_stride, kv_head, shape,
                     out + token * num_heads * head_dim, num_heads * head_dim, q_buffer.data(), q_bf16.data(),
                     acc.data(), scores.data(), lanes);
    }
  }
}

template <typename T>
void paged_decode_attention(const T* query, int64_t q_token_stride, int64_t q_head_stride, const T* key_cache,
                            const T* value_cache, int64_t num_blocks, int64_t block_size, const int32_t* block_tables,
                            int64_t table_stride, const int32_t* seq_lens, const int64_t* token_index, int64_t rows,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale, int64_t window,
                            T* out, int num_threads) {
  paged_attention<T>(query, q_token_stride, q_head_stride, key_cache, value_cache, num_blocks, block_size,
                     block_tables, table_stride, seq_lens, token_index, nullptr, rows, num_heads, num_kv_heads,
                     head_dim, scale, window, 0.f, out, num_threads);
}

template <typename T>
bool store_kv(const T* key, int64_t key_token_stride, int64_t key_head_stride, const T* value,
              int64_t value_token_stride, int64_t value_head_stride, const int64_t* slot_mapping, int64_t tokens,
              int64_t num_kv_heads, int64_t head_dim, int64_t num_slots, T* key_cache, T* value_cache) {
  for (int64_t t = 0; t < tokens; ++t)
    if (slot_mapping[t] < 0 || slot_mapping[t] >= num_slots) return false;
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const int64_t target = (h * num_slots + slot_mapping[t]) * head_dim;
      std::memcpy(key_cache + target, key + t * key_token_stride + h * key_head_stride, head_dim * sizeof(T));
      std::memcpy(value_cache + target, value + t * value_token_stride + h * value_head_stride, head_dim * sizeof(T));
    }
  return true;
}

template bool store_kv<float>(const float*, int64_t, int64_t, const float*, int64_t, int64_t, const int64_t*, int64_t,
                              int64_t, int64_t, int64_t, float*, float*);
template bool store_kv<bf16>(const bf16*, int64_t, int64_t, const bf16*, int64_t, int64_t, const int64_t*, int64_t,
                             int64_t, int64_t, int64_t, bf16*, bf16*);

template void paged_attention<float>(const float*, int64_t, int64_t, const float*, const float*, int64_t, int64_t,
                                     const int32_t*, int64_t, const int32_t*, const int64_t*, const int32_t*, int64_t,
                                     int64_t, int64_t, int64_t, float, int64_t, float, float*, int);
template void paged_attention<bf16>(const bf16*, int64_t, int64_t, const bf16*, const bf16*, int64_t, int64_t,
                                    const int32_t*, int64_t, const int32_t*, const int64_t*, const int32_t*, int64_t,
                                    int64_t, int64_t, int64_t, float, int64_t, float, bf16*, int);
template void paged_decode_attention<float>(const float*, int64_t, int64_t, const float*, const float*, int64_t,
                                            int64_t, const int32_t*, int64_t, const int32_t*, const int64_t*, int64_t,
                                            int64_t, int64_t, int64_t, float, int64_t, float*, int);
template void paged_decode_attention<bf16>(const bf16*, int64_t, int64_t, const bf16*, const bf16*, int64_t, int64_t,
                                           const int32_t*, int64_t, const int32_t*, const int64_t*, int64_t, int64_t,
                                           int64_t, int64_t, float, int64_t, bf16*, int);

}  // namespace kvflow
