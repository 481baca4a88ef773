// The experts of a mixture-of-experts block (FusedMoE) on the CPU: the router's top-k choice comes in, the
// layer's output goes out.
//
// Per call: the (token, slot) pairs are grouped per expert (tokens in ascending order). For each expert that got
// tokens, its rows of x are gathered and its gate_up product, silu(gate) * up and down product each run once over
// all of them, on `product`: the GEMV kernel (gemv.cpp) or the GEMM kernel (gemm.cpp: gemm_kernel() or gemm_float32);
// either reads each weight byte from DRAM once per expert for all its tokens, for any number of tokens. Each result
// row is multiplied by its routing weight (rounded to T) and a token's top_k results are added in ascending expert
// order, each sum rounded to T (the PyTorch path's order). With at least as many selected experts as threads each
// thread takes whole experts (most tokens first) in one parallel region; with fewer, the threads split each
// product's weight rows.
//
// Batch independence: every output element is a dot product whose summation order depends only on K and the
// kernel, not on how many rows the product has or how threads split the work (gemv.cpp, gemm.cpp), and the same
// kernel runs for every group size; so a token's result is bitwise the same alone or in any batch.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "common.h"
#include "kernels.h"
#include "moe_routing.h"

namespace kvflow {
namespace {

// y [M, N] = x [M, K] (rows x_stride apart) @ w [N, K]^T on the chosen kernel.
template <typename T>
void expert_product(MoeProduct product, const T* x, int64_t M, int64_t K, int64_t x_stride, const T* w, int64_t N,
                    T* y, int num_threads) {
  if (product == MoeProduct::kGemm) {
    if constexpr (sizeof(T) == sizeof(bf16))
      gemm(x, M, K, x_stride, w, N, nullptr, y, nullptr, num_threads);
    else
      gemm_float32(x, M, K, x_stride, w, N, y, num_threads);
    return;
  }
  gemv<T>(x, M, K, x_stride, w, N, nullptr, y, nullptr, num_threads);
}

// One expert's products over its `count` pairs (grouped[0 .. count)), results[p] = T(down row * weight of p).
// Scratch buffers hold `count` rows; `num_threads` threads split each product's weight rows.
template <typename T>
struct ExpertScratch {
  std::vector<T> rows, gate_up, activated, down;
  void reserve(int64_t count, int64_t hidden, int64_t intermediate) {
    rows.resize(static_cast<size_t>(count * hidden));
    gate_up.resize(static_cast<size_t>(count * 2 * intermediate));
    activated.resize(static_cast<size_t>(count * intermediate));
    down.resize(static_cast<size_t>(count * hidden));
  }
};

template <typename T>
void run_expert(MoeProduct product, const T* x, int64_t hidden, int64_t x_stride, const T* w13, const T* w2,
                int64_t intermediate, const float* topk_weights, int64_t top_k, const int64_t* grouped, int64_t count,
                ExpertScratch<T>& scratch, T* results, int num_threads) {
  scratch.reserve(count, hidden, intermediate);
  for (int64_t r = 0; r < count; ++r)
    std::copy_n(x + grouped[r] / top_k * x_stride, hidden, scratch.rows.data() + r * hidden);
  expert_product<T>(product, scratch.rows.data(), count, hidden, hidden, w13, 2 * intermediate,
                    scratch.gate_up.data(), num_threads);
  silu_and_mul<T>(scratch.gate_up.data(), count, intermediate, 2 * intermediate, scratch.activated.data(),
                  num_threads);
  expert_product<T>(product, scratch.activated.data(), count, intermediate, intermediate, w2, hidden,
                    scratch.down.data(), num_threads);
  for (int64_t r = 0; r < count; ++r) {
    const float weight = topk_weights[grouped[r]];
    const T* source = scratch.down.data() + r * hidden;
    T* target = results + grouped[r] * hidden;
    for (int64_t h = 0; h < hidden; ++h) target[h] = from_float<T>(to_float<T>(source[h]) * weight);
  }
}

}  // namespace

template <typename T>
bool fused_moe(const T* x, int64_t tokens, int64_t hidden, int64_t x_stride, const T* w13, const T* w2,
               int64_t num_experts, int64_t intermediate, const float* topk_weights, const int64_t* topk_ids,
               int64_t top_k, MoeProduct product, T* out, int num_threads) {
  const int64_t pairs = tokens * top_k;
  ExpertGroups groups;
  if (!group_pairs_by_expert(topk_ids, pairs, num_experts, groups)) return false;
  // results[p] = T(down row * weight) of pair p.
  std::vector<T> results(static_cast<size_t>(pairs * hidden));
  run_active_experts<ExpertScratch<T>>(groups, num_threads, [&](int64_t e, ExpertScratch<T>& scratch, int threads) {
    run_expert<T>(product, x, hidden, x_stride, w13 + e * 2 * intermediate * hidden, w2 + e * hidden * intermediate,
                  intermediate, topk_weights, top_k, groups.pairs_of(e), groups.count(e), scratch, results.data(),
                  threads);
  });
  // Each token's slots in ascending expert order, summed left to right.
#pragma omp parallel for num_threads(num_threads) if (pairs * hidden >= (1 << 16))
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int64_t> slots(top_k);
    slots_in_expert_order(topk_ids + t * top_k, top_k, slots.data());
    T* sum = out + t * hidden;  // each partial sum is a T value: kept in out
    std::copy_n(results.data() + (t * top_k + slots[0]) * hidden, hidden, sum);
    for (int64_t s = 1; s < top_k; ++s) {
      const T* addend = results.data() + (t * top_k + slots[s]) * hidden;
      for (int64_t h = 0; h < hidden; ++h) sum[h] = from_float<T>(to_float<T>(sum[h]) + to_float<T>(addend[h]));
    }
  }
  return true;
}

template bool fused_moe<float>(const float*, int64_t, int64_t, int64_t, const float*, const float*, int64_t, int64_t,
                               const float*, const int64_t*, int64_t, MoeProduct, float*, int);
template bool fused_moe<bf16>(const bf16*, int64_t, int64_t, int64_t, const bf16*, const bf16*, int64_t, int64_t,
                              const float*, const int64_t*, int64_t, MoeProduct, bf16*, int);

}  // namespace kvflow
