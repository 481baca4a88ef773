// Bidirectional varlen attention for encoders (encoder_attention.h).
//
// Work items are (sequence, head, chunk of up to kQueryChunk query rows), longest sequences first, spread over
// the threads dynamically. An item copies its sequence's keys transposed (float32: kt[d][j]; bf16 with vdpbf16ps:
// pairs of dimensions kp[d / 2][j]) and, where needed, its values (float32 rows; or for vdpbf16ps pairs of rows
// interleaved, vp[j / 2][d]), zero-padded to whole 16-lane vectors. Then per block of up to kRowBlock query rows:
// the scores of the block's rows against every key (16 keys per vector, the rows broadcast), the softmax of each
// row over the whole sequence (max subtracted, exp, sum of lanes in a fixed order), and the probabilities times the
// values (head_dim in 16-lane vectors, kDimGroup at a time), scaled by 1 / sum once at the end.
//
// Invariance: each accumulator lane holds one (query row, key) or (query row, dimension) pair and is updated in
// the same order (head_dim ascending, keys ascending) whatever the row block's height or the item's other rows, so
// a row's result depends only on its query row and its sequence's keys and values.
#include "encoder_attention.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"
#include "cpu_features.h"

namespace kvflow {

#ifdef KVFLOW_AVX512
namespace {

constexpr int kRowBlock = 4;           // query rows per register block
constexpr int kKeyVectors = 4;         // 16-key vectors per score block
constexpr int kDimGroup = 4;           // 16-lane head_dim vectors per probabilities x values block
constexpr int64_t kQueryChunk = 256;   // query rows per work item

struct Item {
  int64_t start, length, head, first, count;  // the sequence's first token and length; its query rows
};

// Per-thread buffers, grown as needed and kept between calls.
struct Buffers {
  std::vector<float> keys, values, scores, query;
  std::vector<uint32_t> key_pairs, value_pairs;
  std::vector<bf16> probs;
  float* floats(std::vector<float>& buffer, int64_t count) {
    if (static_cast<int64_t>(buffer.size()) < count) buffer.resize(count);
    return buffer.data();
  }
};

inline int64_t padded_length(int64_t length) { return (length + 15) / 16 * 16; }

// 2^x for 16 floats x <= 0 (clamped at -126: no denormals): 2^round(x) times a Taylor polynomial of 2^f on
// [-1/2, 1/2] of degree kDegree (6: relative error ~2e-7, float32's; 4: ~4e-5, far below bfloat16's 4e-3).
template <int kDegree>
inline __m512 exp2_16(__m512 x) {
  static_assert(kDegree == 4 || kDegree == 6, "degree 4 or 6");
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  // ln(2)^k / k!
  __m512 poly = _mm512_set1_ps(kDegree == 6 ? 1.5403530393381606e-4f : 9.618129107628477e-3f);
  if constexpr (kDegree == 6) {
    poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(1.3333558146428443e-3f));
    poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(9.618129107628477e-3f));
  }
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(5.550410866482158e-2f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(2.402265069591007e-1f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(6.931471805599453e-1f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(poly, n);
}

// Keeps in row_max[r] the largest of the scores acc[r][*] that lie before `length` (keys j0 + 16c + lane).
template <int R, int C>
inline void track_max(const __m512 (&acc)[R][C], int64_t j0, int64_t length, __m512* row_max) {
  for (int c = 0; c < C; ++c) {
    const __mmask16 mask = tail_mask(length - j0 - 16 * c);
    for (int r = 0; r < R; ++r) row_max[r] = _mm512_mask_max_ps(row_max[r], mask, row_max[r], acc[r][c]);
  }
}

// p = 2^((s - max) * scale * log2(e)) = exp(scale * (s - max)) over the row's `length` raw dot products (zeros in
// the padding up to `padded`), written to probs as float32 (exp of degree 6) or bf16 (degree 4, rounded to
// nearest even); returns 1 / the float32 sum of the p before rounding (lanes summed in a fixed order).
inline float softmax_row(const float* scores, int64_t length, int64_t padded, float row_max, float scale,
                         float* probs) {
  const __m512 c = _mm512_set1_ps(scale * 1.4426950408889634f), shift = _mm512_set1_ps(row_max * scale * 1.4426950408889634f);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < padded; j += 16) {
    const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(scores + j), c, shift);
    const __m512 p = _mm512_maskz_mov_ps(tail_mask(length - j), exp2_16<6>(x));
    _mm512_storeu_ps(probs + j, p);
    sum = _mm512_add_ps(sum, p);
  }
  return 1.0f / _mm512_reduce_add_ps(sum);
}

// ---- float32 arithmetic (float32 inputs, or bf16 widened where vdpbf16ps is missing) ----

// scores[r][j0 + 16c + lane] = scale * sum_d q[r][d] * kt[d][j0 + 16c + lane], d ascending.
template <int R, int C>
inline void score_block_f32(const float* q, int64_t head_dim, const float* kt, int64_t padded, int64_t j0,
                            int64_t length, float* scores, __m512* row_max) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t d = 0; d < head_dim; ++d) {
    __m512 k[C];
    for (int c = 0; c < C; ++c) k[c] = _mm512_loadu_ps(kt + d * padded + j0 + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 qv = _mm512_set1_ps(q[r * head_dim + d]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(qv, k[c], acc[r][c]);
    }
  }
  track_max<R, C>(acc, j0, length, row_max);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(scores + r * padded + j0 + 16 * c, acc[r][c]);
}

// out[r][d0 + 16g + lane] = T(inv[r] * sum_j p[r][j] * v[j][d0 + 16g + lane]), j ascending.
template <typename T, int R, int G>
inline void value_block_f32(const float* probs, int64_t padded, int64_t length, const float* v, int64_t v_stride,
                            int64_t d0, const float* inv, T* out, int64_t out_stride) {
  __m512 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  for (int64_t j = 0; j < length; ++j) {
    __m512 vv[G];
    for (int g = 0; g < G; ++g) vv[g] = _mm512_loadu_ps(v + j * v_stride + d0 + 16 * g);
    for (int r = 0; r < R; ++r) {
      const __m512 p = _mm512_set1_ps(probs[r * padded + j]);
      for (int g = 0; g < G; ++g) acc[r][g] = _mm512_fmadd_ps(p, vv[g], acc[r][g]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g)
      store16(out + r * out_stride + d0 + 16 * g, _mm512_mul_ps(acc[r][g], _mm512_set1_ps(inv[r])));
}

template <typename T, int R>
void value_rows_f32(const float* probs, int64_t padded, int64_t length, const float* v, int64_t v_stride,
                    int64_t head_dim, const float* inv, T* out, int64_t out_stride) {
  const int64_t vectors = head_dim / 16;
  for (int64_t g0 = 0; g0 < vectors; g0 += kDimGroup) {
    const int64_t d0 = g0 * 16;
    switch (std::min<int64_t>(kDimGroup, vectors - g0)) {
      case 4: value_block_f32<T, R, 4>(probs, padded, length, v, v_stride, d0, inv, out, out_stride); break;
      case 3: value_block_f32<T, R, 3>(probs, padded, length, v, v_stride, d0, inv, out, out_stride); break;
      case 2: value_block_f32<T, R, 2>(probs, padded, length, v, v_stride, d0, inv, out, out_stride); break;
      default: value_block_f32<T, R, 1>(probs, padded, length, v, v_stride, d0, inv, out, out_stride); break;
    }
  }
}

template <typename T, int R>
void attend_block_f32(const float* q, int64_t head_dim, const float* kt, int64_t padded, int64_t length,
                      const float* v, int64_t v_stride, float scale, float* scores, T* out, int64_t out_stride) {
  __m512 row_max[R];
  for (int r = 0; r < R; ++r) row_max[r] = _mm512_set1_ps(-INFINITY);
  int64_t j0 = 0;
  for (; j0 + 16 * kKeyVectors <= padded; j0 += 16 * kKeyVectors)
    score_block_f32<R, kKeyVectors>(q, head_dim, kt, padded, j0, length, scores, row_max);
  for (; j0 < padded; j0 += 16) score_block_f32<R, 1>(q, head_dim, kt, padded, j0, length, scores, row_max);
  float inv[R];
  for (int r = 0; r < R; ++r)
    inv[r] = softmax_row(scores + r * padded, length, padded, _mm512_reduce_max_ps(row_max[r]), scale,
                         scores + r * padded);
  value_rows_f32<T, R>(scores, padded, length, v, v_stride, head_dim, inv, out, out_stride);
}

template <typename T>
void attend_f32(const T* query, const T* key, const T* value, int64_t token_stride, int64_t head_dim,
                const Item& item, float scale, T* out, int64_t out_stride, Buffers& buffers) {
  const int64_t length = item.length, padded = padded_length(length);
  float* kt = buffers.floats(buffers.keys, head_dim * padded);
  for (int64_t j = 0; j < length; ++j)
    for (int64_t d = 0; d < head_dim; ++d) kt[d * padded + j] = to_float<T>(key[j * token_stride + d]);
  for (int64_t d = 0; d < head_dim; ++d) std::fill(kt + d * padded + length, kt + (d + 1) * padded, 0.0f);
  const float* v;
  int64_t v_stride;
  if constexpr (std::is_same_v<T, float>) {
    v = value;
    v_stride = token_stride;
  } else {
    float* widened = buffers.floats(buffers.values, length * head_dim);
    for (int64_t j = 0; j < length; ++j)
      for (int64_t d = 0; d < head_dim; ++d) widened[j * head_dim + d] = to_float<T>(value[j * token_stride + d]);
    v = widened;
    v_stride = head_dim;
  }
  float* scores = buffers.floats(buffers.scores, kRowBlock * padded);
  float* q = buffers.floats(buffers.query, kRowBlock * head_dim);
  for (int64_t i = item.first, end = item.first + item.count; i < end; i += kRowBlock) {
    const int rows = static_cast<int>(std::min<int64_t>(kRowBlock, end - i));
    for (int r = 0; r < rows; ++r)
      for (int64_t d = 0; d < head_dim; ++d) q[r * head_dim + d] = to_float<T>(query[(i + r) * token_stride + d]);
    T* out_rows = out + i * out_stride;
    switch (rows) {
      case 4: attend_block_f32<T, 4>(q, head_dim, kt, padded, length, v, v_stride, scale, scores, out_rows, out_stride); break;
      case 3: attend_block_f32<T, 3>(q, head_dim, kt, padded, length, v, v_stride, scale, scores, out_rows, out_stride); break;
      case 2: attend_block_f32<T, 2>(q, head_dim, kt, padded, length, v, v_stride, scale, scores, out_rows, out_stride); break;
      default: attend_block_f32<T, 1>(q, head_dim, kt, padded, length, v, v_stride, scale, scores, out_rows, out_stride); break;
    }
  }
}

#ifdef KVFLOW_X86_TARGETS
// ---- bfloat16 on vdpbf16ps (AVX512_BF16) ----
#define KVFLOW_DPBF16 __attribute__((target("avx512bf16")))

inline uint32_t pair_at(const bf16* source) {
  uint32_t pair;
  std::memcpy(&pair, source, sizeof(pair));
  return pair;
}

// scores[r][j0 + 16c + lane] = scale * sum over dimension pairs (ascending) of q[r][pair] . k[j][pair].
template <int R, int C>
KVFLOW_DPBF16 inline void score_block_bf16(const uint32_t* q_pairs, int64_t pairs, const uint32_t* kp, int64_t padded,
                                           int64_t j0, int64_t length, float* scores, __m512* row_max) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh k[C];
    for (int c = 0; c < C; ++c) k[c] = (__m512bh)_mm512_loadu_si512(kp + p * padded + j0 + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512bh qv = (__m512bh)_mm512_set1_epi32(static_cast<int>(q_pairs[r * pairs + p]));
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qv, k[c]);
    }
  }
  track_max<R, C>(acc, j0, length, row_max);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(scores + r * padded + j0 + 16 * c, acc[r][c]);
}

// softmax_row's probabilities rounded to bf16 (vcvtne2ps2bf16: nearest even, denormals flushed: none here) with
// the exp of degree 4; the sum is of the float32 p.
KVFLOW_DPBF16 inline float softmax_row_bf16(const float* scores, int64_t length, int64_t padded, float row_max,
                                            float scale, bf16* probs) {
  const __m512 c = _mm512_set1_ps(scale * 1.4426950408889634f), shift = _mm512_set1_ps(row_max * scale * 1.4426950408889634f);
  __m512 sum = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= padded; j += 32) {
    const __m512 x0 = _mm512_fmsub_ps(_mm512_loadu_ps(scores + j), c, shift);
    const __m512 x1 = _mm512_fmsub_ps(_mm512_loadu_ps(scores + j + 16), c, shift);
    const __m512 p0 = _mm512_maskz_mov_ps(tail_mask(length - j), exp2_16<4>(x0));
    const __m512 p1 = _mm512_maskz_mov_ps(tail_mask(length - j - 16), exp2_16<4>(x1));
    _mm512_storeu_si512(probs + j, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    sum = _mm512_add_ps(sum, p0);
    sum = _mm512_add_ps(sum, p1);
  }
  if (j < padded) {
    const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(scores + j), c, shift);
    const __m512 p = _mm512_maskz_mov_ps(tail_mask(length - j), exp2_16<4>(x));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + j), (__m256i)_mm512_cvtneps_pbh(p));
    sum = _mm512_add_ps(sum, p);
  }
  return 1.0f / _mm512_reduce_add_ps(sum);
}

// out[r][d0 + 16g + lane] = bf16(inv[r] * sum over key pairs (ascending) of p[r][pair] . v[pair][d]).
template <int R, int G>
KVFLOW_DPBF16 inline void value_block_bf16(const bf16* probs, int64_t padded, int64_t key_pairs, const uint32_t* vp,
                                           int64_t head_dim, int64_t d0, const float* inv, bf16* out,
                                           int64_t out_stride) {
  __m512 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  for (int64_t p = 0; p < key_pairs; ++p) {
    __m512bh vv[G];
    for (int g = 0; g < G; ++g) vv[g] = (__m512bh)_mm512_loadu_si512(vp + p * head_dim + d0 + 16 * g);
    for (int r = 0; r < R; ++r) {
      const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair_at(probs + r * padded + 2 * p)));
      for (int g = 0; g < G; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], pv, vv[g]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g)
      store16(out + r * out_stride + d0 + 16 * g, _mm512_mul_ps(acc[r][g], _mm512_set1_ps(inv[r])));
}

template <int R>
KVFLOW_DPBF16 void attend_block_bf16(const uint32_t* q_pairs, int64_t head_dim, const uint32_t* kp, int64_t padded,
                                     int64_t length, const uint32_t* vp, float scale, float* scores, bf16* probs,
                                     bf16* out, int64_t out_stride) {
  const int64_t pairs = head_dim / 2;
  __m512 row_max[R];
  for (int r = 0; r < R; ++r) row_max[r] = _mm512_set1_ps(-INFINITY);
  int64_t j0 = 0;
  for (; j0 + 16 * kKeyVectors <= padded; j0 += 16 * kKeyVectors)
    score_block_bf16<R, kKeyVectors>(q_pairs, pairs, kp, padded, j0, length, scores, row_max);
  for (; j0 < padded; j0 += 16) score_block_bf16<R, 1>(q_pairs, pairs, kp, padded, j0, length, scores, row_max);
  float inv[R];
  for (int r = 0; r < R; ++r)
    inv[r] = softmax_row_bf16(scores + r * padded, length, padded, _mm512_reduce_max_ps(row_max[r]), scale,
                              probs + r * padded);
  const int64_t key_pairs = (length + 1) / 2, vectors = head_dim / 16;
  for (int64_t g0 = 0; g0 < vectors; g0 += kDimGroup) {
    const int64_t d0 = g0 * 16;
    switch (std::min<int64_t>(kDimGroup, vectors - g0)) {
      case 4: value_block_bf16<R, 4>(probs, padded, key_pairs, vp, head_dim, d0, inv, out, out_stride); break;
      case 3: value_block_bf16<R, 3>(probs, padded, key_pairs, vp, head_dim, d0, inv, out, out_stride); break;
      case 2: value_block_bf16<R, 2>(probs, padded, key_pairs, vp, head_dim, d0, inv, out, out_stride); break;
      default: value_block_bf16<R, 1>(probs, padded, key_pairs, vp, head_dim, d0, inv, out, out_stride); break;
    }
  }
}

KVFLOW_DPBF16 void attend_bf16(const bf16* query, const bf16* key, const bf16* value, int64_t token_stride,
                               int64_t head_dim, const Item& item, float scale, bf16* out, int64_t out_stride,
                               Buffers& buffers) {
  const int64_t length = item.length, padded = padded_length(length), pairs = head_dim / 2;
  const int64_t key_pairs = (length + 1) / 2;
  // kp[p][j] = (k[j][2p], k[j][2p + 1]); zeros past the sequence.
  if (static_cast<int64_t>(buffers.key_pairs.size()) < pairs * padded) buffers.key_pairs.resize(pairs * padded);
  uint32_t* kp = buffers.key_pairs.data();
  for (int64_t j = 0; j < length; ++j)
    for (int64_t p = 0; p < pairs; ++p) kp[p * padded + j] = pair_at(key + j * token_stride + 2 * p);
  for (int64_t p = 0; p < pairs; ++p) std::fill(kp + p * padded + length, kp + (p + 1) * padded, 0u);
  // vp[p][d] = (v[2p][d], v[2p + 1][d]); a missing odd row is zeros.
  if (static_cast<int64_t>(buffers.value_pairs.size()) < key_pairs * head_dim)
    buffers.value_pairs.resize(key_pairs * head_dim);
  uint32_t* vp = buffers.value_pairs.data();
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t p = 0; p < key_pairs; ++p) {
    const bf16* even = value + 2 * p * token_stride;
    const bf16* odd = value + (2 * p + 1) * token_stride;
    const bool has_odd = 2 * p + 1 < length;
    for (int64_t d = 0; d < head_dim; d += 16) {
      const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(even + d));
      const __m256i high = has_odd ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd + d))
                                   : _mm256_setzero_si256();
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
      _mm512_storeu_si512(vp + p * head_dim + d, _mm512_permutexvar_epi16(interleave, both));
    }
  }
  float* scores = buffers.floats(buffers.scores, kRowBlock * padded);
  if (static_cast<int64_t>(buffers.probs.size()) < kRowBlock * padded) buffers.probs.resize(kRowBlock * padded);
  bf16* probs = buffers.probs.data();
  uint32_t q_pairs[kRowBlock * 128];
  for (int64_t i = item.first, end = item.first + item.count; i < end; i += kRowBlock) {
    const int rows = static_cast<int>(std::min<int64_t>(kRowBlock, end - i));
    for (int r = 0; r < rows; ++r)
      for (int64_t p = 0; p < pairs; ++p) q_pairs[r * pairs + p] = pair_at(query + (i + r) * token_stride + 2 * p);
    bf16* out_rows = out + i * out_stride;
    switch (rows) {
      case 4: attend_block_bf16<4>(q_pairs, head_dim, kp, padded, length, vp, scale, scores, probs, out_rows, out_stride); break;
      case 3: attend_block_bf16<3>(q_pairs, head_dim, kp, padded, length, vp, scale, scores, probs, out_rows, out_stride); break;
      case 2: attend_block_bf16<2>(q_pairs, head_dim, kp, padded, length, vp, scale, scores, probs, out_rows, out_stride); break;
      default: attend_block_bf16<1>(q_pairs, head_dim, kp, padded, length, vp, scale, scores, probs, out_rows, out_stride); break;
    }
  }
}
#endif  // KVFLOW_X86_TARGETS

}  // namespace
#endif  // KVFLOW_AVX512

bool varlen_attention_uses_dpbf16() {
#if defined(KVFLOW_AVX512) && defined(KVFLOW_X86_TARGETS)
  return cpu_has_avx512_bf16();
#else
  return false;
#endif
}

template <typename T>
bool varlen_attention(const T* query, const T* key, const T* value, int64_t token_stride, int64_t head_stride,
                      const int64_t* cu_seqlens, int64_t num_seqs, int64_t num_heads, int64_t head_dim, float scale,
                      T* out, int num_threads) {
#ifdef KVFLOW_AVX512
  if (head_dim % 16 != 0 || head_dim < 16 || head_dim > 256) return false;
  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t start = cu_seqlens[s], length = cu_seqlens[s + 1] - start;
    for (int64_t h = 0; h < num_heads; ++h)
      for (int64_t first = 0; first < length; first += kQueryChunk)
        items.push_back({start, length, h, first, std::min(kQueryChunk, length - first)});
  }
  // Longest sequences first: the dynamic schedule then ends with the short items.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.length > b.length; });
  const int64_t count = static_cast<int64_t>(items.size());
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, count)));
  const int64_t out_stride = num_heads * head_dim;
  bool dpbf16 = false;
  if constexpr (std::is_same_v<T, bf16>) dpbf16 = varlen_attention_uses_dpbf16();
#pragma omp parallel num_threads(threads)
  {
    static thread_local Buffers buffers;
#pragma omp for schedule(dynamic, 1)
    for (int64_t index = 0; index < count; ++index) {
      const Item& item = items[index];
      const int64_t offset = item.start * token_stride + item.head * head_stride;
      T* item_out = out + item.start * out_stride + item.head * head_dim;
#ifdef KVFLOW_X86_TARGETS
      if constexpr (std::is_same_v<T, bf16>) {
        if (dpbf16) {
          attend_bf16(query + offset, key + offset, value + offset, token_stride, head_dim, item, scale, item_out,
                      out_stride, buffers);
          continue;
        }
      }
#endif
      attend_f32<T>(query + offset, key + offset, value + offset, token_stride, head_dim, item, scale, item_out,
                    out_stride, buffers);
    }
  }
  return true;
#else
  (void)query, (void)key, (void)value, (void)token_stride, (void)head_stride, (void)cu_seqlens, (void)num_seqs;
  (void)num_heads, (void)head_dim, (void)scale, (void)out, (void)num_threads;
  return false;
#endif
}

template bool varlen_attention<float>(const float*, const float*, const float*, int64_t, int64_t, const int64_t*,
                                      int64_t, int64_t, int64_t, float, float*, int);
template bool varlen_attention<bf16>(const bf16*, const bf16*, const bf16*, int64_t, int64_t, const int64_t*, int64_t,
                                     int64_t, int64_t, float, bf16*, int);

}  // namespace kvflow
