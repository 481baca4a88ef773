// Paged decode attention: one query token per row, K/V read in place through the block table (no gather),
// online softmax in fp32. One work item is (row, kv head): its query-head group (GQA) shares each loaded K/V row.
#include <omp.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "common.h"
#include "kernels.h"

namespace kvflow {
namespace {

constexpr int kMaxGroup = 32;  // bindings.cpp refuses larger query groups per KV head

template <typename T>
void attend_one(const T* query, int64_t q_head_stride, const T* key_cache, const T* value_cache, int64_t num_blocks,
                int64_t block_size, const int32_t* table, int64_t seq_len, int64_t kv_head, int64_t group,
                int64_t head_dim, float scale, int64_t window, T* out, float* q_buffer, float* acc, float* scores) {
  const int64_t padded_dim = (head_dim + 15) / 16 * 16;
  float running_max[kMaxGroup], running_sum[kMaxGroup];
  for (int64_t g = 0; g < group; ++g) {
    const T* q = query + (kv_head * group + g) * q_head_stride;
    for (int64_t d = 0; d < padded_dim; ++d) {
      q_buffer[g * padded_dim + d] = d < head_dim ? to_float<T>(q[d]) * scale : 0.f;
      acc[g * padded_dim + d] = 0.f;
    }
    running_max[g] = -std::numeric_limits<float>::infinity();
    running_sum[g] = 0.f;
  }
  const int64_t start = window > 0 ? std::max<int64_t>(0, seq_len - window) : 0;
  for (int64_t b = start / block_size; b * block_size < seq_len; ++b) {
    const int64_t first = std::max(start, b * block_size) - b * block_size;
    const int64_t last = std::min(seq_len - b * block_size, block_size);
    const int64_t offset = ((kv_head * num_blocks + table[b]) * block_size) * head_dim;
    const T* keys = key_cache + offset;
    const T* values = value_cache + offset;
    for (int64_t j = first; j < last; ++j) {
      const T* key = keys + j * head_dim;
#ifdef KVFLOW_AVX512
      __m512 partial[kMaxGroup];
      for (int64_t g = 0; g < group; ++g) partial[g] = _mm512_setzero_ps();
      for (int64_t d = 0; d < head_dim; d += 16) {
        __m512 k = load16(key + d, tail_mask(head_dim - d));
        for (int64_t g = 0; g < group; ++g)
          partial[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q_buffer + g * padded_dim + d), k, partial[g]);
      }
      for (int64_t g = 0; g < group; ++g) scores[g * block_size + j] = _mm512_reduce_add_ps(partial[g]);
#else
      for (int64_t g = 0; g < group; ++g) {
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t d = 0; d < head_dim; ++d) sum += q_buffer[g * padded_dim + d] * to_float<T>(key[d]);
        scores[g * block_size + j] = sum;
      }
#endif
    }
    for (int64_t g = 0; g < group; ++g) {
      float* s = scores + g * block_size;
      float block_max = running_max[g];
      for (int64_t j = first; j < last; ++j) block_max = std::max(block_max, s[j]);
      const float correction = std::exp(running_max[g] - block_max);
      float block_sum = 0.f;
      for (int64_t j = first; j < last; ++j) {
        s[j] = std::exp(s[j] - block_max);
        block_sum += s[j];
      }
      running_sum[g] = running_sum[g] * correction + block_sum;
      running_max[g] = block_max;
      if (correction != 1.f)
        for (int64_t d = 0; d < padded_dim; ++d) acc[g * padded_dim + d] *= correction;
    }
    for (int64_t j = first; j < last; ++j) {
      const T* value = values + j * head_dim;
#ifdef KVFLOW_AVX512
      for (int64_t d = 0; d < head_dim; d += 16) {
        __m512 v = load16(value + d, tail_mask(head_dim - d));
        for (int64_t g = 0; g < group; ++g) {
          float* a = acc + g * padded_dim + d;
          _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(scores[g * block_size + j]), v, _mm512_loadu_ps(a)));
        }
      }
#else
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[g * block_size + j];
        for (int64_t d = 0; d < head_dim; ++d) acc[g * padded_dim + d] += p * to_float<T>(value[d]);
      }
#endif
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inverse = 1.f / running_sum[g];
    T* o = out + (kv_head * group + g) * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) o[d] = from_float<T>(acc[g * padded_dim + d] * inverse);
  }
}

}  // namespace

template <typename T>
void paged_decode_attention(const T* query, int64_t q_token_stride, int64_t q_head_stride, const T* key_cache,
                            const T* value_cache, int64_t num_blocks, int64_t block_size, const int32_t* block_tables,
                            int64_t table_stride, const int32_t* seq_lens, const int64_t* token_index, int64_t rows,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale, int64_t window,
                            T* out, int num_threads) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t padded_dim = (head_dim + 15) / 16 * 16;
  const int64_t items = rows * num_kv_heads;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, items)));
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> q_buffer(group * padded_dim), acc(group * padded_dim), scores(group * block_size);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t row = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t token = token_index[row];
      attend_one<T>(query + token * q_token_stride, q_head_stride, key_cache, value_cache, num_blocks, block_size,
                    block_tables + row * table_stride, seq_lens[row], kv_head, group, head_dim, scale, window,
                    out + token * num_heads * head_dim, q_buffer.data(), acc.data(), scores.data());
    }
  }
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

template void paged_decode_attention<float>(const float*, int64_t, int64_t, const float*, const float*, int64_t,
                                            int64_t, const int32_t*, int64_t, const int32_t*, const int64_t*, int64_t,
                                            int64_t, int64_t, int64_t, float, int64_t, float*, int);
template void paged_decode_attention<bf16>(const bf16*, int64_t, int64_t, const bf16*, const bf16*, int64_t, int64_t,
                                           const int32_t*, int64_t, const int32_t*, const int64_t*, int64_t, int64_t,
                                           int64_t, int64_t, float, int64_t, bf16*, int);

}  // namespace kvflow
