// Bidirectional attention over packed variable-length sequences, for encoders (BERT / XLM-RoBERTa): no cache, no
// mask beyond the sequence bounds. Raw pointers only (bindings.cpp checks the tensors).
#pragma once

#include <cstdint>

namespace kvflow {
using bf16 = uint16_t;  // bfloat16 bits

// Sequence s holds tokens [cu_seqlens[s], cu_seqlens[s + 1]); each of its tokens attends to every token of the
// sequence and none other, with scores scale * q.k and an exact softmax (max subtracted, the whole row at once).
// query / key / value token t, head h start at base + t * token_stride + h * head_stride (head_dim contiguous, the
// same strides for the three); out[t * num_heads * head_dim + h * head_dim + d] (contiguous).
// Row and batch invariant by construction: every output row is computed by the same sequence of operations from its
// own query row and its sequence's keys and values, whatever the other rows and sequences.
// float32: fp32 products and sums. bfloat16: on a CPU with AVX512_BF16, vdpbf16ps on the bf16 q, k (exact
// products, fp32 sums) and on the probabilities rounded to bf16 against v; elsewhere widened to the float32 path.
// Returns false (writing nothing) where it does not apply: a build without AVX-512, or head_dim not a multiple of
// 16 in [16, 256].
template <typename T>
bool varlen_attention(const T* query, const T* key, const T* value, int64_t token_stride, int64_t head_stride,
                      const int64_t* cu_seqlens, int64_t num_seqs, int64_t num_heads, int64_t head_dim, float scale,
                      T* out, int num_threads);

// Whether the bfloat16 path runs vdpbf16ps on this CPU (AVX512_BF16 in CPUID, an AVX-512 build).
bool varlen_attention_uses_dpbf16();

}  // namespace kvflow
