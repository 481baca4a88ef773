// What both mixture-of-experts kernels (fused_moe.cpp: float weights; quant_moe.cpp: GGUF blocks / int8 rows) do
// around their experts' products: group the router's (token, slot) pairs per expert, run each selected expert on
// the threads, and visit a token's slots in ascending expert order for the sum.
//
// Invariants: `grouped[starts[e] .. starts[e + 1])` are expert e's pairs (p = token * top_k + slot) in ascending
// order (a counting sort, stable); `active` holds every expert with pairs, most pairs first (ties by expert id), so
// the dynamic schedule balances the threads; how the threads split the work never changes which kernel computes an
// element or its summation order.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace kvflow {

struct ExpertGroups {
  std::vector<int64_t> starts;   // [num_experts + 1]: expert e's pairs are grouped[starts[e] .. starts[e + 1])
  std::vector<int64_t> grouped;  // [pairs]: pair indices, grouped per expert
  std::vector<int64_t> active;   // the experts with pairs, most pairs first

  int64_t count(int64_t expert) const { return starts[expert + 1] - starts[expert]; }
  const int64_t* pairs_of(int64_t expert) const { return grouped.data() + starts[expert]; }
};

// False (nothing grouped) when an id is outside [0, num_experts).
inline bool group_pairs_by_expert(const int64_t* topk_ids, int64_t pairs, int64_t num_experts, ExpertGroups& groups) {
  for (int64_t p = 0; p < pairs; ++p)
    if (topk_ids[p] < 0 || topk_ids[p] >= num_experts) return false;
  groups.starts.assign(num_experts + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) ++groups.starts[topk_ids[p] + 1];
  for (int64_t e = 0; e < num_experts; ++e) groups.starts[e + 1] += groups.starts[e];
  groups.grouped.resize(pairs);
  std::vector<int64_t> next(groups.starts.begin(), groups.starts.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) groups.grouped[next[topk_ids[p]]++] = p;
  groups.active.clear();
  for (int64_t e = 0; e < num_experts; ++e)
    if (groups.count(e) > 0) groups.active.push_back(e);
  std::stable_sort(groups.active.begin(), groups.active.end(),
                   [&](int64_t a, int64_t b) { return groups.count(a) > groups.count(b); });
  return true;
}

// Runs `expert(e, scratch, product_threads)` for every active expert. Fewer experts than threads: one after the
// other, each product's threads splitting its weight rows; else each thread takes whole experts (one parallel
// region, no barrier per product), every product on one thread. `Scratch` is each thread's reusable buffers.
template <typename Scratch, typename RunExpert>
void run_active_experts(const ExpertGroups& groups, int num_threads, RunExpert&& expert) {
  const int64_t num_active = static_cast<int64_t>(groups.active.size());
  if (num_active < num_threads) {
    Scratch scratch;
    for (int64_t e : groups.active) expert(e, scratch, num_threads);
    return;
  }
#pragma omp parallel num_threads(num_threads)
  {
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_active; ++i) expert(groups.active[i], scratch, 1);
  }
}

// slots[0 .. top_k): token's slots ordered by ascending expert id (top_k is small: an insertion sort; stable).
inline void slots_in_expert_order(const int64_t* token_ids, int64_t top_k, int64_t* slots) {
  for (int64_t s = 0; s < top_k; ++s) {
    int64_t i = s;
    for (; i > 0 && token_ids[slots[i - 1]] > token_ids[s]; --i) slots[i] = slots[i - 1];
    slots[i] = s;
  }
}

}  // namespace kvflow
