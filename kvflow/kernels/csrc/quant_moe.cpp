// The experts of a mixture-of-experts block on quantized weights (FusedMoE with GGUF blocks or int8 rows): the
// router's top-k choice comes in, the layer's output goes out, in one call per layer.
//
// Per call: the (token, slot) pairs are grouped per expert (tokens in ascending order, a counting sort). For each
// expert that got tokens, its rows of x are gathered (fp32) and its gate_up product, silu(gate) * up and down
// product each run once over all of them, on the dense layers' quantized products (quant_linear.cpp): each
// expert's weights are read once per call for all its tokens. `expert_product` picks the product by the group's
// row count exactly as kvflow/kernels/quant.py picks it for a dense layer of that many rows, so a group of M
// tokens computes what `ggml_linear` / `int8_linear` on those M rows computes:
// * Q4_0 / Q4_K / Q6_K: the integer product at every M (x quantized per block; the GEMV up to
//   k_quant_interleaved_above_rows() rows, the interleaved tiles above on AVX-512 VNNI builds);
// * Q8_0: the GEMV up to gemv_max_rows (x quantized per 32, or fp32 x under KVFLOW_Q8_0_ACTIVATIONS=float32), the
//   tiled product up to tiled_max_rows, above that W8A8 where built (has_w8a8_kernels), else the tiled product;
// * int8 (kInt8Weights, a float32 scale per row): the GEMV up to gemv_max_rows, above it W8A8 (or tiled).
// Each result row is multiplied by its routing weight in fp32 and a token's top_k results are added in ascending
// expert order in fp32, then rounded to T once.
//
// Threads: with at least as many selected experts as threads each thread takes whole experts (most tokens first,
// dynamic schedule), every product on one thread, in one parallel region; with fewer, the experts run one after
// the other and each product's threads split its weight rows. Every product sums each output element on one
// thread in an order fixed by K and its kernel (quant_internal.h), so the thread split changes no bit.
//
// Batch independence: a token's result depends only on its own row and, through the kernel each group size
// picks, on how many tokens its experts got: bitwise the same alone or in any batch where each of its experts
// stays within the same kernel range (Q4_0 / Q4_K / Q6_K: up to 8 tokens per expert on VNNI builds, any count
// otherwise; Q8_0 and int8: up to gemv_max_rows).
#include <omp.h>

#include <algorithm>
#include <vector>

#include "common.h"
#include "kernels.h"
#include "moe_routing.h"

namespace kvflow {
namespace {

// One stacked expert weight: `experts` matrices [N, K] of `type` (a GgmlType, or kInt8Weights with `scale`
// [experts, N]), each `expert_bytes` apart.
struct ExpertMatrices {
  const uint8_t* data;
  const float* scale;
  int type;
  int64_t N, K, expert_bytes;
};

struct ProductRows {
  int64_t gemv_max_rows, tiled_max_rows;
};

// y [M, N] float32 = x [M, K] float32 (contiguous rows) times expert e's matrix, on the dense product for M rows.
void expert_product(const ExpertMatrices& w, int64_t e, const float* x, int64_t M, const ProductRows& limits,
                    float* y, int num_threads) {
  const uint8_t* weights = w.data + e * w.expert_bytes;
  if (w.type == kInt8Weights) {
    int8_linear<float>(x, M, w.K, w.K, reinterpret_cast<const int8_t*>(weights), w.scale + e * w.N, w.N, nullptr,
                       y, limits.gemv_max_rows, num_threads);
    return;
  }
  if (w.type == kGgmlQ8_0) {
    if (M > limits.tiled_max_rows && has_w8a8_kernels()) {
      ggml_linear_w8a8<float>(x, M, w.K, w.K, weights, w.N, w.type, nullptr, y, num_threads);
      return;
    }
    ggml_linear<float>(x, M, w.K, w.K, weights, w.N, w.type, nullptr, y, limits.gemv_max_rows, num_threads);
    return;
  }
  ggml_linear<float>(x, M, w.K, w.K, weights, w.N, w.type, nullptr, y, M, num_threads);  // integer, every M
}

struct ExpertScratch {
  std::vector<float> rows, gate_up, activated, down;
  void reserve(int64_t count, int64_t hidden, int64_t intermediate) {
    rows.resize(static_cast<size_t>(count * hidden));
    gate_up.resize(static_cast<size_t>(count * 2 * intermediate));
    activated.resize(static_cast<size_t>(count * intermediate));
    down.resize(static_cast<size_t>(count * hidden));
  }
};

// Expert e over its `count` pairs (grouped[0 .. count)): results[p] = down row * weight of pair p (float32).
template <typename T>
void run_expert(const T* x, int64_t x_stride, const ExpertMatrices& w13, const ExpertMatrices& w2, int64_t e,
                const float* topk_weights, int64_t top_k, const int64_t* grouped, int64_t count,
                const ProductRows& limits, ExpertScratch& scratch, float* results, int num_threads) {
  const int64_t hidden = w13.K, intermediate = w2.K;
  scratch.reserve(count, hidden, intermediate);
  for (int64_t r = 0; r < count; ++r) {
    const T* source = x + grouped[r] / top_k * x_stride;
    float* target = scratch.rows.data() + r * hidden;
    for (int64_t h = 0; h < hidden; ++h) target[h] = to_float<T>(source[h]);
  }
  expert_product(w13, e, scratch.rows.data(), count, limits, scratch.gate_up.data(), num_threads);
  silu_and_mul<float>(scratch.gate_up.data(), count, intermediate, 2 * intermediate, scratch.activated.data(), 1);
  expert_product(w2, e, scratch.activated.data(), count, limits, scratch.down.data(), num_threads);
  for (int64_t r = 0; r < count; ++r) {
    const float weight = topk_weights[grouped[r]];
    const float* source = scratch.down.data() + r * hidden;
    float* target = results + grouped[r] * hidden;
    for (int64_t h = 0; h < hidden; ++h) target[h] = source[h] * weight;
  }
}

}  // namespace

template <typename T>
bool quant_fused_moe(const T* x, int64_t tokens, int64_t hidden, int64_t x_stride, const uint8_t* w13,
                     const float* w13_scale, int w13_type, const uint8_t* w2, const float* w2_scale, int w2_type,
                     int64_t num_experts, int64_t intermediate, const float* topk_weights, const int64_t* topk_ids,
                     int64_t top_k, int64_t gemv_max_rows, int64_t tiled_max_rows, T* out, int num_threads) {
  const int64_t pairs = tokens * top_k;
  (void)q8_0_int8_activations();  // a bad KVFLOW_Q8_0_ACTIVATIONS throws here, before the experts' threads start
  auto row_bytes = [](int type, int64_t K) {
    return type == kInt8Weights ? K : K / ggml_block_elements(type) * ggml_block_bytes(type);
  };
  const ExpertMatrices gate_up{w13, w13_scale, w13_type, 2 * intermediate, hidden,
                               2 * intermediate * row_bytes(w13_type, hidden)};
  const ExpertMatrices down{w2, w2_scale, w2_type, hidden, intermediate, hidden * row_bytes(w2_type, intermediate)};
  const ProductRows limits{gemv_max_rows, tiled_max_rows};
  ExpertGroups groups;
  if (!group_pairs_by_expert(topk_ids, pairs, num_experts, groups)) return false;
  std::vector<float> results(static_cast<size_t>(pairs * hidden));
  run_active_experts<ExpertScratch>(groups, num_threads, [&](int64_t e, ExpertScratch& scratch, int threads) {
    run_expert<T>(x, x_stride, gate_up, down, e, topk_weights, top_k, groups.pairs_of(e), groups.count(e), limits,
                  scratch, results.data(), threads);
  });
  // Each token's slots in ascending expert order, summed left to right in fp32.
#pragma omp parallel for num_threads(num_threads) if (pairs * hidden >= (1 << 16))
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int64_t> slots(top_k);
    slots_in_expert_order(topk_ids + t * top_k, top_k, slots.data());
    std::vector<float> sum(results.begin() + (t * top_k + slots[0]) * hidden,
                           results.begin() + (t * top_k + slots[0] + 1) * hidden);
    for (int64_t s = 1; s < top_k; ++s) {
      const float* addend = results.data() + (t * top_k + slots[s]) * hidden;
      for (int64_t h = 0; h < hidden; ++h) sum[h] += addend[h];
    }
    for (int64_t h = 0; h < hidden; ++h) out[t * hidden + h] = from_float<T>(sum[h]);
  }
  return true;
}

template bool quant_fused_moe<float>(const float*, int64_t, int64_t, int64_t, const uint8_t*, const float*, int,
                                     const uint8_t*, const float*, int, int64_t, int64_t, const float*,
                                     const int64_t*, int64_t, int64_t, int64_t, float*, int);
template bool quant_fused_moe<bf16>(const bf16*, int64_t, int64_t, int64_t, const uint8_t*, const float*, int,
                                    const uint8_t*, const float*, int, int64_t, int64_t, const float*,
                                    const int64_t*, int64_t, int64_t, int64_t, bf16*, int);

}  // namespace kvflow
