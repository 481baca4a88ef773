// Python bindings: tensor checks (TORCH_CHECK names the argument) and dispatch to the raw kernels by dtype.
// Every op runs on at::get_num_threads() threads of the OpenMP runtime torch itself uses.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <iterator>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_features.h"
#include "encoder_attention.h"
#include "kernels.h"

namespace {

using kvflow::bf16;

void check_cpu(const at::Tensor& tensor, const char* name) {
  TORCH_CHECK(tensor.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(tensor.scalar_type() == at::kBFloat16 || tensor.scalar_type() == at::kFloat, name,
              " must be bfloat16 or float32, got ", tensor.scalar_type());
}

void check_same_dtype(const at::Tensor& tensor, const at::Tensor& reference, const char* name) {
  TORCH_CHECK(tensor.scalar_type() == reference.scalar_type(), name, " must have dtype ", reference.scalar_type(),
              ", got ", tensor.scalar_type());
}

template <typename Fn>
void dispatch(const at::Tensor& tensor, Fn&& fn) {
  if (tensor.scalar_type() == at::kBFloat16)
    fn(bf16{});
  else
    fn(float{});
}

template <typename T>
T* ptr(const at::Tensor& tensor) {
  return reinterpret_cast<T*>(tensor.data_ptr());
}

// x [M, K] with contiguous rows, weight [N, K] contiguous, bias [N] or none, all of x's dtype.
void check_product_operands(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  check_same_dtype(weight, x, "weight");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be 2-D with contiguous rows");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1),
              "weight must be contiguous [N, K] with K = x.size(1)");
  if (bias) {
    check_same_dtype(*bias, x, "bias");
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == weight.size(0), "bias must be contiguous [N]");
  }
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                  bool float_output) {
  check_cpu(x, "x");
  check_product_operands(x, weight, bias);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor out = at::empty({M, N}, x.options().dtype(float_output ? at::kFloat : x.scalar_type()));
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    kvflow::gemv<T>(ptr<T>(x), M, K, x.stride(0), ptr<T>(weight), N, bias ? ptr<T>(*bias) : nullptr,
                    float_output ? nullptr : ptr<T>(out), float_output ? ptr<float>(out) : nullptr,
                    at::get_num_threads());
  });
  return out;
}

// x [M, K] bf16 @ weight.T (+ bias) on `kernel` (bf16 out, or its values as float32 with float_output).
at::Tensor bf16_product(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                        bool float_output, kvflow::GemmKernel kernel) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16, "x must be a bfloat16 CPU tensor");
  check_product_operands(x, weight, bias);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor out = at::empty({M, N}, x.options().dtype(float_output ? at::kFloat : at::kBFloat16));
  if (M == 0 || N == 0) return out;
  kvflow::gemm_with(kernel, ptr<bf16>(x), M, K, x.stride(0), ptr<bf16>(weight), N, bias ? ptr<bf16>(*bias) : nullptr,
                    float_output ? nullptr : ptr<bf16>(out), float_output ? ptr<float>(out) : nullptr,
                    at::get_num_threads());
  return out;
}

at::Tensor gemm(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                bool float_output) {
  return bf16_product(x, weight, bias, float_output, kvflow::gemm_kernel());
}

// gemm's kernels by name, in GemmKernel's order.
const char* const kGemmKernelNames[] = {"widened_fp32", "avx512_bf16", "amx_bf16", "amx_bf16_emulated"};

kvflow::GemmKernel gemm_kernel_named(const std::string& name) {
  std::string known;
  for (int i = 0; i < static_cast<int>(std::size(kGemmKernelNames)); ++i) {
    if (name == kGemmKernelNames[i]) return static_cast<kvflow::GemmKernel>(i);
    known += (i ? ", " : "") + std::string(kGemmKernelNames[i]);
  }
  TORCH_CHECK(false, "kernel must be one of ", known, "; got '", name, "'");
}

std::string gemm_kernel_name(kvflow::GemmKernel kernel) { return kGemmKernelNames[static_cast<int>(kernel)]; }

at::Tensor gemm_with(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                     bool float_output, const std::string& kernel) {
  const kvflow::GemmKernel chosen = gemm_kernel_named(kernel);
  TORCH_CHECK(chosen != kvflow::GemmKernel::kAmxBf16 || kvflow::amx_usable(),
              "kernel amx_bf16: this CPU (or process) cannot use AMX tiles");
  return bf16_product(x, weight, bias, float_output, chosen);
}

int64_t stream_read(const at::Tensor& data) {
  TORCH_CHECK(data.is_contiguous() && data.scalar_type() == at::kByte, "data must be a contiguous uint8 tensor");
  return static_cast<int64_t>(
      kvflow::stream_read(ptr<uint8_t>(data), data.numel() / 64 * 64, at::get_num_threads()) & 0x7fffffff);
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps) {
  check_cpu(x, "x");
  check_same_dtype(weight, x, "weight");
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  const int64_t hidden = x.size(-1), rows = x.numel() / std::max<int64_t>(hidden, 1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == hidden, "weight must be contiguous [hidden]");
  at::Tensor out = at::empty_like(x);
  at::Tensor summed = x;
  if (residual) {
    check_same_dtype(*residual, x, "residual");
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes(), "residual must be contiguous like x");
    summed = at::empty_like(x);
  }
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    kvflow::add_rms_norm<T>(ptr<T>(x), residual ? ptr<T>(*residual) : nullptr, ptr<T>(weight), rows, hidden,
                            static_cast<float>(eps), ptr<T>(out), residual ? ptr<T>(summed) : nullptr,
                            at::get_num_threads());
  });
  return {out, summed};
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_cpu(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be 2-D [rows, 2 * d] with contiguous rows");
  const int64_t rows = gate_up.size(0), d = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, d}, gate_up.options());
  dispatch(gate_up, [&](auto tag) {
    using T = decltype(tag);
    kvflow::silu_and_mul<T>(ptr<T>(gate_up), rows, d, gate_up.stride(0), ptr<T>(out), at::get_num_threads());
  });
  return out;
}

// x [T, H] with contiguous rows; w13 [E, 2I, H], w2 [E, H, I] contiguous, x's dtype; topk_weights float32 and
// topk_ids int64, both contiguous [T, k]. `gemm`: the products on the GEMM kernel (else the GEMV kernel).
at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& topk_weights,
                     const at::Tensor& topk_ids, bool gemm) {
  check_cpu(x, "x");
  check_same_dtype(w13, x, "w13");
  check_same_dtype(w2, x, "w2");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be 2-D with contiguous rows");
  const int64_t tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK(w13.dim() == 3 && w13.is_contiguous() && w13.size(1) % 2 == 0 && w13.size(2) == hidden,
              "w13 must be contiguous [E, 2 * I, hidden]");
  const int64_t num_experts = w13.size(0), intermediate = w13.size(1) / 2;
  TORCH_CHECK(w2.dim() == 3 && w2.is_contiguous() && w2.size(0) == num_experts && w2.size(1) == hidden &&
                  w2.size(2) == intermediate,
              "w2 must be contiguous [E, hidden, I]");
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat && topk_weights.is_contiguous() && topk_weights.dim() == 2 &&
                  topk_weights.size(0) == tokens,
              "topk_weights must be contiguous float32 [tokens, k]");
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong && topk_ids.is_contiguous() &&
                  topk_ids.sizes() == topk_weights.sizes(),
              "topk_ids must be contiguous int64 of topk_weights' shape");
  at::Tensor out = at::empty({tokens, hidden}, x.options());
  bool ok = true;
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    ok = kvflow::fused_moe<T>(ptr<T>(x), tokens, hidden, x.stride(0), ptr<T>(w13), ptr<T>(w2), num_experts,
                              intermediate, ptr<float>(topk_weights), ptr<int64_t>(topk_ids), topk_ids.size(1),
                              gemm ? kvflow::MoeProduct::kGemm : kvflow::MoeProduct::kGemv, ptr<T>(out),
                              at::get_num_threads());
  });
  TORCH_CHECK(ok, "topk_ids must lie in [0, ", num_experts, ")");
  return out;
}

at::Tensor rotary(const at::Tensor& heads, const at::Tensor& cos, const at::Tensor& sin) {
  check_cpu(heads, "heads");
  check_same_dtype(cos, heads, "cos");
  check_same_dtype(sin, heads, "sin");
  TORCH_CHECK(heads.dim() == 3 && heads.stride(2) == 1 && heads.size(2) % 2 == 0,
              "heads must be [tokens, heads, head_dim] with contiguous head_dim (even)");
  const int64_t tokens = heads.size(0), num_heads = heads.size(1), head_dim = heads.size(2);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == tokens * head_dim / 2 &&
                  sin.numel() == cos.numel(),
              "cos and sin must be contiguous [tokens, 1, head_dim / 2]");
  at::Tensor out = at::empty({tokens, num_heads, head_dim}, heads.options());
  dispatch(heads, [&](auto tag) {
    using T = decltype(tag);
    kvflow::rotary<T>(ptr<T>(heads), tokens, num_heads, head_dim, heads.stride(0), heads.stride(1), ptr<T>(cos),
                      ptr<T>(sin), ptr<T>(out), at::get_num_threads());
  });
  return out;
}

void paged_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& token_start,
                     const c10::optional<at::Tensor>& query_lens, double scale, int64_t window, double softcap,
                     at::Tensor& out) {
  check_cpu(query, "query");
  check_same_dtype(key_cache, query, "key_cache");
  check_same_dtype(value_cache, query, "value_cache");
  check_same_dtype(out, query, "out");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [tokens, heads, head_dim], head_dim contiguous");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  value_cache.sizes() == key_cache.sizes(),
              "key_cache/value_cache must be contiguous [kv_heads, blocks, block_size, head_dim]");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1 && block_tables.scalar_type() == at::kInt,
              "block_tables must be int32 [rows, max_blocks] with contiguous rows");
  TORCH_CHECK(seq_lens.is_contiguous() && seq_lens.scalar_type() == at::kInt, "seq_lens must be contiguous int32");
  TORCH_CHECK(token_start.is_contiguous() && token_start.scalar_type() == at::kLong,
              "token_start must be contiguous int64");
  const int64_t rows = token_start.numel();
  TORCH_CHECK(seq_lens.numel() == rows && block_tables.size(0) == rows, "block_tables/seq_lens need one row each");
  const int32_t* lens = nullptr;
  if (query_lens.has_value()) {
    TORCH_CHECK(query_lens->is_contiguous() && query_lens->scalar_type() == at::kInt && query_lens->numel() == rows,
                "query_lens must be contiguous int32, one per row");
    lens = ptr<int32_t>(*query_lens);
  }
  const int64_t num_heads = query.size(1), head_dim = query.size(2), num_kv_heads = key_cache.size(0);
  TORCH_CHECK(key_cache.size(3) == head_dim && num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= 32,
              "key_cache head_dim must match query; heads per kv head must divide evenly and be <= 32");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == query.sizes(), "out must be contiguous like query");
  dispatch(query, [&](auto tag) {
    using T = decltype(tag);
    kvflow::paged_attention<T>(ptr<T>(query), query.stride(0), query.stride(1), ptr<T>(key_cache),
                               ptr<T>(value_cache), key_cache.size(1), key_cache.size(2), ptr<int32_t>(block_tables),
                               block_tables.stride(0), ptr<int32_t>(seq_lens), ptr<int64_t>(token_start), lens, rows,
                               num_heads, num_kv_heads, head_dim, static_cast<float>(scale), window,
                               static_cast<float>(softcap), ptr<T>(out), at::get_num_threads());
  });
}

void store_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& slot_mapping, at::Tensor& key_cache,
              at::Tensor& value_cache) {
  check_cpu(key, "key");
  check_same_dtype(value, key, "value");
  check_same_dtype(key_cache, key, "key_cache");
  check_same_dtype(value_cache, key, "value_cache");
  TORCH_CHECK(key.dim() == 3 && key.stride(2) == 1 && value.sizes() == key.sizes() && value.stride(2) == 1,
              "key/value must be [tokens, kv_heads, head_dim] with contiguous head_dim");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  value_cache.sizes() == key_cache.sizes() && key_cache.size(0) == key.size(1) &&
                  key_cache.size(3) == key.size(2),
              "key_cache/value_cache must be contiguous [kv_heads, blocks, block_size, head_dim] matching key");
  TORCH_CHECK(slot_mapping.is_contiguous() && slot_mapping.scalar_type() == at::kLong &&
                  slot_mapping.numel() == key.size(0),
              "slot_mapping must be contiguous int64 with one slot per token");
  const int64_t num_slots = key_cache.size(1) * key_cache.size(2);
  bool stored = false;
  dispatch(key, [&](auto tag) {
    using T = decltype(tag);
    stored = kvflow::store_kv<T>(ptr<T>(key), key.stride(0), key.stride(1), ptr<T>(value), value.stride(0),
                                 value.stride(1), ptr<int64_t>(slot_mapping), key.size(0), key.size(1), key.size(2), num_slots, ptr<T>(key_cache),
                                 ptr<T>(value_cache));
  });
  TORCH_CHECK(stored, "slot_mapping has a slot outside the cache's ", num_slots, " slots");
}

void check_weight(const at::Tensor& weight, const at::Tensor& x, int64_t rows, int64_t cols, const char* name) {
  check_same_dtype(weight, x, name);
  TORCH_CHECK(weight.is_contiguous() && weight.dim() == 2 && weight.size(0) == rows && weight.size(1) == cols, name,
              " must be contiguous [", rows, ", ", cols, "], got ", weight.sizes());
}

template <typename T>
const T* optional_vector(const c10::optional<at::Tensor>& tensor, const at::Tensor& x, int64_t size,
                         const char* name) {
  if (!tensor) return nullptr;
  check_same_dtype(*tensor, x, name);
  TORCH_CHECK(tensor->is_contiguous() && tensor->numel() == size, name, " must be contiguous [", size, "]");
  return ptr<T>(*tensor);
}

// The step's shapes and paging as decode_layer and decode_layer_quantized check them (weights aside).
struct DecodeStep {
  kvflow::DecodeLayerParams params;
  int64_t layer_stride, value_offset;  // kv_cache strides: per layer, and V after K
};

DecodeStep check_decode_step(const at::Tensor& hidden, const c10::optional<at::Tensor>& residual,
                             const at::Tensor& input_norm, const at::Tensor& post_norm,
                             const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                             int64_t intermediate,
                             const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_cache, int64_t layer,
                             const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, int64_t num_heads, double eps, double scale, int64_t window,
                             int64_t gemv_max_rows) {
  check_cpu(hidden, "hidden");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "hidden must be contiguous [rows, hidden]");
  const int64_t M = hidden.size(0), H = hidden.size(1);
  TORCH_CHECK(M >= 1 && M <= kvflow::kMaxDecodeLayerRows, "rows must be in [1, ", kvflow::kMaxDecodeLayerRows,
              "], got ", M);
  if (residual) {
    check_same_dtype(*residual, hidden, "residual");
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == hidden.sizes(), "residual must be like hidden");
  }
  check_same_dtype(kv_cache, hidden, "kv_cache");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous() && kv_cache.size(1) == 2 && layer >= 0 &&
                  layer < kv_cache.size(0),
              "kv_cache must be contiguous [layers, 2, kv_heads, blocks, block_size, head_dim] holding `layer`");
  const int64_t nkv = kv_cache.size(2), num_blocks = kv_cache.size(3), block_size = kv_cache.size(4),
                hd = kv_cache.size(5);
  TORCH_CHECK(num_heads > 0 && num_heads % nkv == 0 && num_heads / nkv <= 32,
              "num_heads must be a multiple of the cache's kv heads, at most 32 per kv head");
  check_weight(input_norm.view({1, -1}), hidden, 1, H, "input_norm");
  check_weight(post_norm.view({1, -1}), hidden, 1, H, "post_norm");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm come together (or neither)");
  if (q_norm) {
    check_weight(q_norm->view({1, -1}), hidden, 1, hd, "q_norm");
    check_weight(k_norm->view({1, -1}), hidden, 1, hd, "k_norm");
  }
  check_same_dtype(cos, hidden, "cos");
  check_same_dtype(sin, hidden, "sin");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == M * hd / 2 && sin.numel() == cos.numel(),
              "cos and sin must be contiguous [rows, 1, head_dim / 2]");
  TORCH_CHECK(slot_mapping.is_contiguous() && slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == M,
              "slot_mapping must be contiguous int64 [rows]");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == M && block_tables.stride(1) == 1 &&
                  block_tables.scalar_type() == at::kInt,
              "block_tables must be int32 [rows, max_blocks] with contiguous rows");
  TORCH_CHECK(seq_lens.is_contiguous() && seq_lens.scalar_type() == at::kInt && seq_lens.numel() == M,
              "seq_lens must be contiguous int32 [rows]");
  kvflow::DecodeLayerParams params{M,
                                   H,
                                   intermediate,
                                   num_heads,
                                   nkv,
                                   hd,
                                   static_cast<float>(eps),
                                   static_cast<float>(scale),
                                   window,
                                   num_blocks,
                                   block_size,
                                   ptr<int64_t>(slot_mapping),
                                   ptr<int32_t>(block_tables),
                                   block_tables.stride(0),
                                   ptr<int32_t>(seq_lens),
                                   gemv_max_rows};
  return {params, kv_cache.stride(0), kv_cache.stride(1)};
}

// LoRA adapter rows in a fused decode step: each row's adapter slot (None: no adapter rows) and, for each of the
// four products (qkv, o, gate_up, down), its slots' A [slots, parts * rank, K], B [slots, N, rank] and part offsets
// (0 .. N), as lora_add takes them; all three lists empty when the layers carry no adapters.
struct DecodeLora {
  const c10::optional<at::Tensor>& token_slots;
  const std::vector<at::Tensor>& a;
  const std::vector<at::Tensor>& b;
  const std::vector<std::vector<int64_t>>& part_offsets;
};

// Checks `lora` against the layer's products (K[i] inputs, N[i] outputs) and puts it into params and weights.
// The four products' (qkv, o, gate_up, down) input widths K and output widths N for a layer of `p`'s sizes.
struct ProductDims {
  int64_t K[4];
  int64_t N[4];
};
ProductDims product_dims(const kvflow::DecodeLayerParams& p) {
  return {{p.hidden, p.num_heads * p.head_dim, p.hidden, p.intermediate},
          {p.qkv_width(), p.hidden, 2 * p.intermediate, p.hidden}};
}

template <typename T>
void fill_decode_lora(const DecodeLora& lora, const at::Tensor& hidden, const int64_t (&K)[4], const int64_t (&N)[4],
                      kvflow::DecodeLayerParams& params, kvflow::DecodeLayerWeights<T>& weights) {
  if (!lora.token_slots) return;
  const at::Tensor& slots = *lora.token_slots;
  TORCH_CHECK(slots.device().is_cpu() && slots.scalar_type() == at::kInt && slots.is_contiguous() &&
                  slots.numel() == params.rows,
              "lora_token_slots must be a contiguous int32 CPU tensor [rows]");
  TORCH_CHECK(lora.a.size() == 4 && lora.b.size() == 4 && lora.part_offsets.size() == 4,
              "lora_a, lora_b and lora_part_offsets need one entry per product (qkv, o, gate_up, down)");
  kvflow::LayerProduct<T>* products[4] = {&weights.qkv, &weights.o, &weights.gate_up, &weights.down};
  const int32_t* slot_of_row = ptr<int32_t>(slots);
  for (int i = 0; i < 4; ++i) {
    const at::Tensor& a = lora.a[i];
    const at::Tensor& b = lora.b[i];
    const std::vector<int64_t>& offsets = lora.part_offsets[i];
    check_same_dtype(a, hidden, "lora_a");
    check_same_dtype(b, hidden, "lora_b");
    const int64_t num_parts = static_cast<int64_t>(offsets.size()) - 1;
    TORCH_CHECK(num_parts >= 1 && num_parts <= kvflow::kMaxProductRuns && offsets.front() == 0 &&
                    offsets.back() == N[i],
                "lora_part_offsets must run from 0 to the product's ", N[i], " rows in 1 to ",
                kvflow::kMaxProductRuns, " parts");
    TORCH_CHECK(b.dim() == 3 && b.is_contiguous() && b.size(1) == N[i], "lora_b must be contiguous [slots, ", N[i],
                ", rank]");
    const int64_t num_slots = b.size(0), rank = b.size(2);
    TORCH_CHECK(a.dim() == 3 && a.is_contiguous() && a.size(0) == num_slots && a.size(1) == num_parts * rank &&
                    a.size(2) == K[i],
                "lora_a must be contiguous [", num_slots, ", ", num_parts * rank, ", ", K[i], "]");
    for (int64_t r = 0; r < params.rows; ++r)
      TORCH_CHECK(slot_of_row[r] >= -1 && slot_of_row[r] < num_slots, "lora_token_slots must lie in [-1, ",
                  num_slots, ")");
    kvflow::LoraProduct<T>& target = products[i]->lora;
    target.a = ptr<T>(a);
    target.b = ptr<T>(b);
    target.num_slots = num_slots;
    target.rank = rank;
    target.num_parts = num_parts;
    std::copy(offsets.begin(), offsets.end(), target.part_offsets);
  }
  params.lora_token_slots = slot_of_row;
}

// Runs decode_layer<T> with the weights `make_weights(tag)` gives (and `lora`'s adapter rows); returns
// (out, residual_out).
template <class MakeWeights>
std::tuple<at::Tensor, at::Tensor> run_decode_layer(const DecodeStep& step, const at::Tensor& hidden,
                                                    const c10::optional<at::Tensor>& residual,
                                                    const at::Tensor& cos, const at::Tensor& sin,
                                                    at::Tensor& kv_cache, int64_t layer, bool quantized,
                                                    const DecodeLora& lora, MakeWeights&& make_weights) {
  kvflow::DecodeLayerParams params = step.params;
  const ProductDims dims = product_dims(params);
  at::Tensor workspace = at::empty({params.workspace_elements()}, hidden.options());
  at::Tensor scratch = at::empty({quantized ? params.quant_scratch_elements() : 0}, hidden.options().dtype(at::kFloat));
  at::Tensor out = at::empty_like(hidden);
  at::Tensor residual_out = at::empty_like(hidden);
  bool stored = false;
  dispatch(hidden, [&](auto tag) {
    using T = decltype(tag);
    kvflow::DecodeLayerWeights<T> weights = make_weights(tag);
    fill_decode_lora<T>(lora, hidden, dims.K, dims.N, params, weights);
    T* layer_cache = ptr<T>(kv_cache) + layer * step.layer_stride;
    stored = kvflow::decode_layer<T>(params, weights, ptr<T>(hidden), residual ? ptr<T>(*residual) : nullptr,
                                     ptr<T>(cos), ptr<T>(sin), layer_cache, layer_cache + step.value_offset,
                                     ptr<T>(workspace), ptr<T>(out), ptr<T>(residual_out),
                                     quantized ? ptr<float>(scratch) : nullptr, at::get_num_threads());
  });
  TORCH_CHECK(stored, "slot_mapping has a slot outside the cache's ", params.num_blocks * params.block_size,
              " slots");
  return {out, residual_out};
}

// A layer's norm pointers (the per-head q/k norms null without), what every layer's DecodeLayerWeights starts from.
template <typename T>
kvflow::DecodeLayerWeights<T> layer_norms(const at::Tensor& input_norm, const at::Tensor& post_norm,
                                          const c10::optional<at::Tensor>& q_norm,
                                          const c10::optional<at::Tensor>& k_norm) {
  kvflow::DecodeLayerWeights<T> w{ptr<T>(input_norm), ptr<T>(post_norm)};
  w.q_norm = q_norm ? ptr<T>(*q_norm) : nullptr;
  w.k_norm = k_norm ? ptr<T>(*k_norm) : nullptr;
  return w;
}

// A dense layer's weights (the products already checked against the layer's sizes; each bias checked here against
// `like`'s dtype and its product's rows), for decode_layer and DecodeLayerStack alike.
template <typename T>
kvflow::DecodeLayerWeights<T> dense_layer_weights(
    const at::Tensor& like, int64_t hidden, int64_t intermediate, const at::Tensor& input_norm,
    const at::Tensor& post_norm, const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
    const at::Tensor& qkv, const c10::optional<at::Tensor>& qkv_bias, const at::Tensor& o,
    const c10::optional<at::Tensor>& o_bias, const at::Tensor& gate_up, const c10::optional<at::Tensor>& gate_up_bias,
    const at::Tensor& down, const c10::optional<at::Tensor>& down_bias) {
  kvflow::DecodeLayerWeights<T> w = layer_norms<T>(input_norm, post_norm, q_norm, k_norm);
  w.qkv.dense = ptr<T>(qkv);
  w.qkv.bias = optional_vector<T>(qkv_bias, like, qkv.size(0), "qkv_bias");
  w.o.dense = ptr<T>(o);
  w.o.bias = optional_vector<T>(o_bias, like, hidden, "o_bias");
  w.gate_up.dense = ptr<T>(gate_up);
  w.gate_up.bias = optional_vector<T>(gate_up_bias, like, 2 * intermediate, "gate_up_bias");
  w.down.dense = ptr<T>(down);
  w.down.bias = optional_vector<T>(down_bias, like, hidden, "down_bias");
  return w;
}

std::tuple<at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& hidden, const c10::optional<at::Tensor>& residual, const at::Tensor& input_norm,
    const at::Tensor& post_norm, const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
    const at::Tensor& qkv, const c10::optional<at::Tensor>& qkv_bias,
    const at::Tensor& o, const c10::optional<at::Tensor>& o_bias, const at::Tensor& gate_up,
    const c10::optional<at::Tensor>& gate_up_bias, const at::Tensor& down, const c10::optional<at::Tensor>& down_bias,
    const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kv_cache, int64_t layer, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t num_heads, double eps, double scale,
    int64_t window, int64_t gemv_max_rows, const c10::optional<at::Tensor>& lora_token_slots,
    const std::vector<at::Tensor>& lora_a, const std::vector<at::Tensor>& lora_b,
    const std::vector<std::vector<int64_t>>& lora_part_offsets) {
  const DecodeStep step =
      check_decode_step(hidden, residual, input_norm, post_norm, q_norm, k_norm, down.size(1), cos, sin, kv_cache,
                        layer, slot_mapping, block_tables, seq_lens, num_heads, eps, scale, window, gemv_max_rows);
  const kvflow::DecodeLayerParams& p = step.params;
  check_weight(qkv, hidden, p.qkv_width(), p.hidden, "qkv");
  check_weight(o, hidden, p.hidden, num_heads * p.head_dim, "o");
  check_weight(gate_up, hidden, 2 * p.intermediate, p.hidden, "gate_up");
  check_weight(down, hidden, p.hidden, p.intermediate, "down");
  const DecodeLora lora{lora_token_slots, lora_a, lora_b, lora_part_offsets};
  return run_decode_layer(step, hidden, residual, cos, sin, kv_cache, layer, false, lora, [&](auto tag) {
    using T = decltype(tag);
    return dense_layer_weights<T>(hidden, p.hidden, p.intermediate, input_norm, post_norm, q_norm, k_norm, qkv,
                                  qkv_bias, o, o_bias, gate_up, gate_up_bias, down, down_bias);
  });
}

int64_t ggml_columns(const at::Tensor& blocks, int64_t type);  // below, with the other quantized ops

// One product's quantized runs from the flat lists decode_layer_quantized takes; checks each against K and N.
void fill_quant_product(kvflow::QuantRun* runs, int* num_runs, const std::vector<at::Tensor>& weights,
                        const std::vector<int64_t>& types, const std::vector<at::Tensor>& scales,
                        const std::vector<at::Tensor>& biases, const std::vector<int64_t>& gemv_max_rows,
                        int64_t first, int64_t count, int64_t K, int64_t N, const char* name) {
  TORCH_CHECK(count >= 1 && count <= kvflow::kMaxProductRuns, name, ": 1 to ", kvflow::kMaxProductRuns,
              " runs, got ", count);
  int64_t rows = 0;
  for (int64_t i = 0; i < count; ++i) {
    const at::Tensor& weight = weights[first + i];
    const int64_t type = types[first + i];
    const at::Tensor& scale = scales[first + i];
    const at::Tensor& bias = biases[first + i];
    TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.device().is_cpu(), name,
                ": run weights must be contiguous 2-D CPU tensors");
    if (type == kvflow::kInt8Weights) {
      TORCH_CHECK(weight.scalar_type() == at::kChar && weight.size(1) == K, name, ": int8 run must be [rows, ", K,
                  "]");
      TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == weight.size(0),
                  name, ": an int8 run's scale must be contiguous float32 [rows]");
    } else {
      TORCH_CHECK(ggml_columns(weight, type) == K, name, ": run blocks must hold ", K, " columns");
    }
    if (bias.numel() > 0)
      TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == weight.size(0), name,
                  ": a run's bias must be contiguous float32 [rows] (empty: none)");
    runs[i] = {weight.data_ptr(), static_cast<int>(type), weight.size(0),
               type == kvflow::kInt8Weights ? ptr<float>(scale) : nullptr,
               bias.numel() > 0 ? ptr<float>(bias) : nullptr, gemv_max_rows[first + i]};
    rows += weight.size(0);
  }
  TORCH_CHECK(rows == N, name, ": its runs hold ", rows, " rows, the layer needs ", N);
  *num_runs = static_cast<int>(count);
}

// The flat per-run lists hold one entry per run of the four products (`runs_per_product`).
void check_run_lists(const std::vector<at::Tensor>& weights, const std::vector<int64_t>& types,
                     const std::vector<at::Tensor>& scales, const std::vector<at::Tensor>& biases,
                     const std::vector<int64_t>& gemv_max_rows, const std::vector<int64_t>& runs_per_product) {
  TORCH_CHECK(runs_per_product.size() == 4, "runs_per_product must have 4 entries (qkv, o, gate_up, down)");
  const size_t total = static_cast<size_t>(runs_per_product[0] + runs_per_product[1] + runs_per_product[2] +
                                           runs_per_product[3]);
  TORCH_CHECK(weights.size() == total && types.size() == total && scales.size() == total &&
                  biases.size() == total && gemv_max_rows.size() == total,
              "weights, types, scales, biases and gemv_max_rows must each have one entry per run (", total, ")");
}

// A quantized layer's weights (the lists checked by check_run_lists; each run checked against its product's K
// and N here), for decode_layer_quantized and DecodeLayerStack alike.
template <typename T>
kvflow::DecodeLayerWeights<T> quantized_layer_weights(
    const ProductDims& dims, const at::Tensor& input_norm, const at::Tensor& post_norm,
    const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
    const std::vector<at::Tensor>& weights, const std::vector<int64_t>& types, const std::vector<at::Tensor>& scales,
    const std::vector<at::Tensor>& biases, const std::vector<int64_t>& gemv_max_rows,
    const std::vector<int64_t>& runs_per_product) {
  kvflow::DecodeLayerWeights<T> w = layer_norms<T>(input_norm, post_norm, q_norm, k_norm);
  kvflow::LayerProduct<T>* products[4] = {&w.qkv, &w.o, &w.gate_up, &w.down};
  const char* names[4] = {"qkv", "o", "gate_up", "down"};
  int64_t first = 0;
  for (int i = 0; i < 4; ++i) {
    fill_quant_product(products[i]->runs, &products[i]->num_runs, weights, types, scales, biases, gemv_max_rows,
                       first, runs_per_product[i], dims.K[i], dims.N[i], names[i]);
    first += runs_per_product[i];
  }
  return w;
}

// decode_layer with quantized products (q_norm / k_norm as decode_layer's): the four products' runs (qkv, o,
// gate_up, down) in one flat list each of weights (GGUF blocks, or int8), type codes (kvflow::GgmlType, or
// kInt8Weights), scales (int8 runs; else empty), float32 biases (empty: none) and the gemv_max_rows each run's
// product takes (QuantRun); `runs_per_product` says how many runs each product takes.
std::tuple<at::Tensor, at::Tensor> decode_layer_quantized(
    const at::Tensor& hidden, const c10::optional<at::Tensor>& residual, const at::Tensor& input_norm,
    const at::Tensor& post_norm, const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
    const std::vector<at::Tensor>& weights, const std::vector<int64_t>& types,
    const std::vector<at::Tensor>& scales, const std::vector<at::Tensor>& biases,
    const std::vector<int64_t>& gemv_max_rows, const std::vector<int64_t>& runs_per_product, int64_t intermediate,
    const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kv_cache, int64_t layer, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t num_heads, double eps, double scale,
    int64_t window, const c10::optional<at::Tensor>& lora_token_slots, const std::vector<at::Tensor>& lora_a,
    const std::vector<at::Tensor>& lora_b, const std::vector<std::vector<int64_t>>& lora_part_offsets) {
  const DecodeStep step =
      check_decode_step(hidden, residual, input_norm, post_norm, q_norm, k_norm, intermediate, cos, sin, kv_cache,
                        layer, slot_mapping, block_tables, seq_lens, num_heads, eps, scale, window, 0);
  check_run_lists(weights, types, scales, biases, gemv_max_rows, runs_per_product);
  const ProductDims dims = product_dims(step.params);
  const DecodeLora lora{lora_token_slots, lora_a, lora_b, lora_part_offsets};
  return run_decode_layer(step, hidden, residual, cos, sin, kv_cache, layer, true, lora, [&](auto tag) {
    using T = decltype(tag);
    return quantized_layer_weights<T>(dims, input_norm, post_norm, q_norm, k_norm, weights, types, scales, biases,
                                      gemv_max_rows, runs_per_product);
  });
}

// A model's decoder layers for fused decode steps, gathered and checked once (kvflow.models.fused_decode keeps
// one per model), so that a step is one call: `run` takes only what changes per step and chains decode_layer over
// every layer exactly as one decode_layer / decode_layer_quantized call per layer would (the same kernels in the
// same order, each layer's output its next layer's input), so its results equal theirs bit for bit.
// Invariants: every layer's weights were checked against the dims and dtype given at construction; the tensors
// are held, so their pointers stay valid and a weight loader's in-place copy into them is seen by the next step;
// a quantized run's bias in another dtype than float32 has a float32 copy that `run` refreshes before the layers
// run (as the per-layer call converts it per call). Layer i reads and writes kv_cache[i] and reads the paging of
// its window group (`window_group`, an index into run's block_tables / seq_lens / windows).
class DecodeLayerStack {
 public:
  DecodeLayerStack(at::ScalarType dtype, int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   double eps, double scale, int64_t gemv_max_rows)
      : reference_(at::empty({0}, at::TensorOptions().dtype(dtype))),
        hidden_(hidden),
        num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        eps_(eps),
        scale_(scale),
        gemv_max_rows_(gemv_max_rows) {
    TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "dtype must be bfloat16 or float32");
    TORCH_CHECK(hidden > 0 && head_dim > 0 && num_kv_heads > 0 && num_heads > 0 && num_heads % num_kv_heads == 0 &&
                    num_heads / num_kv_heads <= 32,
                "num_heads must be a positive multiple of num_kv_heads, at most 32 per kv head");
  }

  void add_dense_layer(const at::Tensor& input_norm, const at::Tensor& post_norm,
                       const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                       const at::Tensor& qkv, const c10::optional<at::Tensor>& qkv_bias, const at::Tensor& o,
                       const c10::optional<at::Tensor>& o_bias, const at::Tensor& gate_up,
                       const c10::optional<at::Tensor>& gate_up_bias, const at::Tensor& down,
                       const c10::optional<at::Tensor>& down_bias, int64_t window_group) {
    const int64_t intermediate = down.dim() == 2 ? down.size(1) : 0;
    check_weight(qkv, reference_, qkv_width(), hidden_, "qkv");
    check_weight(o, reference_, hidden_, num_heads_ * head_dim_, "o");
    check_weight(gate_up, reference_, 2 * intermediate, hidden_, "gate_up");
    check_weight(down, reference_, hidden_, intermediate, "down");
    Layer layer = new_layer(input_norm, post_norm, q_norm, k_norm, intermediate, window_group);
    layer.held.insert(layer.held.end(), {qkv, o, gate_up, down});
    for (const auto* bias : {&qkv_bias, &o_bias, &gate_up_bias, &down_bias})
      if (*bias) layer.held.push_back(**bias);
    dispatch(reference_, [&](auto tag) {
      using T = decltype(tag);
      weights<T>().push_back(dense_layer_weights<T>(reference_, hidden_, intermediate, input_norm, post_norm, q_norm,
                                                    k_norm, qkv, qkv_bias, o, o_bias, gate_up, gate_up_bias, down,
                                                    down_bias));
    });
    layers_.push_back(std::move(layer));
  }

  // The lists as decode_layer_quantized takes them, except that a bias may have any floating dtype (a float32
  // copy is kept; empty: none).
  void add_quantized_layer(const at::Tensor& input_norm, const at::Tensor& post_norm,
                           const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                           const std::vector<at::Tensor>& run_weights, const std::vector<int64_t>& types,
                           const std::vector<at::Tensor>& scales, const std::vector<at::Tensor>& biases,
                           const std::vector<int64_t>& gemv_max_rows, const std::vector<int64_t>& runs_per_product,
                           int64_t intermediate, int64_t window_group) {
    check_run_lists(run_weights, types, scales, biases, gemv_max_rows, runs_per_product);
    Layer layer = new_layer(input_norm, post_norm, q_norm, k_norm, intermediate, window_group);
    std::vector<at::Tensor> float_biases;
    for (const at::Tensor& bias : biases) {
      if (bias.numel() == 0 || bias.scalar_type() == at::kFloat) {
        float_biases.push_back(bias);
        continue;
      }
      TORCH_CHECK(bias.device().is_cpu() && bias.dim() == 1, "a run's bias must be a 1-D CPU tensor");
      at::Tensor copy = at::empty({bias.numel()}, bias.options().dtype(at::kFloat));
      copy.copy_(bias);
      bias_copies_.push_back({bias, copy});
      float_biases.push_back(copy);
    }
    layer.held.insert(layer.held.end(), run_weights.begin(), run_weights.end());
    layer.held.insert(layer.held.end(), scales.begin(), scales.end());
    layer.held.insert(layer.held.end(), float_biases.begin(), float_biases.end());
    kvflow::DecodeLayerParams sizes{};
    sizes.hidden = hidden_;
    sizes.intermediate = intermediate;
    sizes.num_heads = num_heads_;
    sizes.num_kv_heads = num_kv_heads_;
    sizes.head_dim = head_dim_;
    const ProductDims dims = product_dims(sizes);
    dispatch(reference_, [&](auto tag) {
      using T = decltype(tag);
      weights<T>().push_back(quantized_layer_weights<T>(dims, input_norm, post_norm, q_norm, k_norm, run_weights,
                                                        types, scales, float_biases, gemv_max_rows,
                                                        runs_per_product));
    });
    any_quantized_ = true;
    layers_.push_back(std::move(layer));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // (last layer's out, its residual_out) of a decode-only step, as decode_layer returns them; `block_tables`,
  // `seq_lens` and `windows` hold one entry per window group (checked as decode_layer checks its own).
  std::tuple<at::Tensor, at::Tensor> run(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                                         at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                                         const std::vector<at::Tensor>& block_tables,
                                         const std::vector<at::Tensor>& seq_lens,
                                         const std::vector<int64_t>& windows) {
    TORCH_CHECK(!layers_.empty(), "the stack has no layers");
    check_cpu(hidden, "hidden");
    check_same_dtype(hidden, reference_, "hidden");
    TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && hidden.size(1) == hidden_,
                "hidden must be contiguous [rows, ", hidden_, "]");
    const int64_t M = hidden.size(0);
    TORCH_CHECK(M >= 1 && M <= kvflow::kMaxDecodeLayerRows, "rows must be in [1, ", kvflow::kMaxDecodeLayerRows,
                "], got ", M);
    check_same_dtype(kv_cache, hidden, "kv_cache");
    TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous() && kv_cache.size(0) >= num_layers() &&
                    kv_cache.size(1) == 2 && kv_cache.size(2) == num_kv_heads_ && kv_cache.size(5) == head_dim_,
                "kv_cache must be contiguous [layers, 2, ", num_kv_heads_, ", blocks, block_size, ", head_dim_,
                "] holding every layer");
    check_same_dtype(cos, hidden, "cos");
    check_same_dtype(sin, hidden, "sin");
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == M * head_dim_ / 2 &&
                    sin.numel() == cos.numel(),
                "cos and sin must be contiguous [rows, 1, head_dim / 2]");
    TORCH_CHECK(slot_mapping.is_contiguous() && slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == M,
                "slot_mapping must be contiguous int64 [rows]");
    const size_t num_groups = static_cast<size_t>(num_window_groups_);
    TORCH_CHECK(block_tables.size() == num_groups && seq_lens.size() == num_groups && windows.size() == num_groups,
                "block_tables, seq_lens and windows need one entry per window group (", num_groups, ")");
    const int64_t num_blocks = kv_cache.size(3), block_size = kv_cache.size(4);
    std::vector<kvflow::DecodeLayerParams> group_params;
    group_params.reserve(num_groups);
    for (size_t g = 0; g < num_groups; ++g) {
      const at::Tensor& tables = block_tables[g];
      const at::Tensor& lens = seq_lens[g];
      TORCH_CHECK(tables.dim() == 2 && tables.size(0) == M && tables.stride(1) == 1 &&
                      tables.scalar_type() == at::kInt,
                  "block_tables must be int32 [rows, max_blocks] with contiguous rows");
      TORCH_CHECK(lens.is_contiguous() && lens.scalar_type() == at::kInt && lens.numel() == M,
                  "seq_lens must be contiguous int32 [rows]");
      group_params.push_back({M, hidden_, 0, num_heads_, num_kv_heads_, head_dim_, static_cast<float>(eps_),
                              static_cast<float>(scale_), windows[g], num_blocks, block_size,
                              ptr<int64_t>(slot_mapping), ptr<int32_t>(tables), tables.stride(0),
                              ptr<int32_t>(lens), gemv_max_rows_});
    }
    kvflow::DecodeLayerParams sizing = group_params[0];
    sizing.intermediate = max_intermediate_;
    at::Tensor workspace = at::empty({sizing.workspace_elements()}, hidden.options());
    at::Tensor scratch =
        at::empty({any_quantized_ ? sizing.quant_scratch_elements() : 0}, hidden.options().dtype(at::kFloat));
    // Layer i writes pair i % 2 and reads the other (layer 0 reads `hidden` and no residual).
    at::Tensor outs[2] = {at::empty_like(hidden), at::empty_like(hidden)};
    at::Tensor residuals[2] = {at::empty_like(hidden), at::empty_like(hidden)};
    for (const BiasCopy& bias : bias_copies_) bias.copy.copy_(bias.source);
    const int64_t layer_stride = kv_cache.stride(0), value_offset = kv_cache.stride(1);
    bool stored = true;
    {
      py::gil_scoped_release no_gil;
      dispatch(hidden, [&](auto tag) {
        using T = decltype(tag);
        const std::vector<kvflow::DecodeLayerWeights<T>>& layer_weights = weights<T>();
        const int num_threads = at::get_num_threads();
        const T* layer_in = ptr<T>(hidden);
        const T* layer_residual = nullptr;
        for (size_t i = 0; i < layers_.size() && stored; ++i) {
          kvflow::DecodeLayerParams params = group_params[static_cast<size_t>(layers_[i].window_group)];
          params.intermediate = layers_[i].intermediate;
          T* layer_cache = ptr<T>(kv_cache) + static_cast<int64_t>(i) * layer_stride;
          T* out = ptr<T>(outs[i % 2]);
          T* residual_out = ptr<T>(residuals[i % 2]);
          stored = kvflow::decode_layer<T>(params, layer_weights[i], layer_in, layer_residual, ptr<T>(cos),
                                           ptr<T>(sin), layer_cache, layer_cache + value_offset,
                                           ptr<T>(workspace), out, residual_out,
                                           any_quantized_ ? ptr<float>(scratch) : nullptr, num_threads);
          layer_in = out;
          layer_residual = residual_out;
        }
      });
    }
    TORCH_CHECK(stored, "slot_mapping has a slot outside the cache's ", num_blocks * block_size, " slots");
    const size_t last = (layers_.size() - 1) % 2;
    return {outs[last], residuals[last]};
  }

 private:
  struct Layer {
    std::vector<at::Tensor> held;  // every tensor the layer's pointers point into
    int64_t intermediate = 0;
    int64_t window_group = 0;
  };
  struct BiasCopy {
    at::Tensor source;  // the parameter (bfloat16, float16, ...)
    at::Tensor copy;    // float32, what the layer's run points to
  };

  int64_t qkv_width() const { return (num_heads_ + 2 * num_kv_heads_) * head_dim_; }

  // Checks the norms, the intermediate size and the window group; the layer holds the norms.
  Layer new_layer(const at::Tensor& input_norm, const at::Tensor& post_norm, const c10::optional<at::Tensor>& q_norm,
                  const c10::optional<at::Tensor>& k_norm, int64_t intermediate, int64_t window_group) {
    TORCH_CHECK(intermediate > 0, "intermediate must be positive");
    TORCH_CHECK(window_group >= 0 && window_group <= num_window_groups_,
                "window groups must be numbered in order of first use from 0");
    check_weight(input_norm.view({1, -1}), reference_, 1, hidden_, "input_norm");
    check_weight(post_norm.view({1, -1}), reference_, 1, hidden_, "post_norm");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm come together (or neither)");
    Layer layer;
    layer.held = {input_norm, post_norm};
    if (q_norm) {
      check_weight(q_norm->view({1, -1}), reference_, 1, head_dim_, "q_norm");
      check_weight(k_norm->view({1, -1}), reference_, 1, head_dim_, "k_norm");
      layer.held.insert(layer.held.end(), {*q_norm, *k_norm});
    }
    layer.intermediate = intermediate;
    layer.window_group = window_group;
    num_window_groups_ = std::max(num_window_groups_, window_group + 1);
    max_intermediate_ = std::max(max_intermediate_, intermediate);
    return layer;
  }

  template <typename T>
  std::vector<kvflow::DecodeLayerWeights<T>>& weights() {
    if constexpr (std::is_same_v<T, bf16>)
      return bf16_weights_;
    else
      return float_weights_;
  }

  at::Tensor reference_;  // an empty tensor of the stack's dtype, what checks compare dtypes with
  int64_t hidden_, num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  int64_t gemv_max_rows_;
  int64_t num_window_groups_ = 0;
  int64_t max_intermediate_ = 0;
  bool any_quantized_ = false;
  std::vector<Layer> layers_;
  std::vector<kvflow::DecodeLayerWeights<bf16>> bf16_weights_;  // one per layer (bfloat16 stacks)
  std::vector<kvflow::DecodeLayerWeights<float>> float_weights_;  // one per layer (float32 stacks)
  std::vector<BiasCopy> bias_copies_;
};

// Quantized weights (quant_*.cpp): x [M, K] bfloat16/float32 with contiguous rows; the result is float32 [M, N].
void check_quant_operands(const at::Tensor& x, const at::Tensor& weight, int64_t K,
                          const c10::optional<at::Tensor>& bias) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) == K, "x must be 2-D [M, ", K,
              "] with contiguous rows, got ", x.sizes());
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.device().is_cpu(),
              "the weight must be a contiguous 2-D CPU tensor");
  if (bias)
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == weight.size(0),
                "bias must be contiguous float32 [N]");
}

int64_t ggml_columns(const at::Tensor& blocks, int64_t type) {
  TORCH_CHECK(type >= kvflow::kGgmlQ8_0 && type <= kvflow::kGgmlQ6_K, "unknown GGML type code ", type);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
                  blocks.device().is_cpu(),
              "blocks must be a contiguous uint8 CPU tensor [rows, row_bytes]");
  const int64_t bytes = kvflow::ggml_block_bytes(static_cast<int>(type));
  TORCH_CHECK(blocks.size(1) % bytes == 0, "rows must be whole blocks of ", bytes, " bytes, got ", blocks.size(1));
  return blocks.size(1) / bytes * kvflow::ggml_block_elements(static_cast<int>(type));
}

at::Tensor ggml_dequantize(const at::Tensor& blocks, int64_t type) {
  const int64_t columns = ggml_columns(blocks, type);
  at::Tensor out = at::empty({blocks.size(0), columns}, blocks.options().dtype(at::kFloat));
  kvflow::ggml_dequantize(ptr<uint8_t>(blocks), blocks.size(0), blocks.size(1), static_cast<int>(type),
                          ptr<float>(out), at::get_num_threads());
  return out;
}

// A quantized product's float32 output [M, N]: fn(tag, out) runs the kernel for x's element type (nothing when
// the product is empty).
template <class F>
at::Tensor float_product(const at::Tensor& x, int64_t N, F&& fn) {
  at::Tensor out = at::empty({x.size(0), N}, x.options().dtype(at::kFloat));
  if (x.size(0) == 0 || N == 0) return out;
  dispatch(x, [&](auto tag) { fn(tag, out); });
  return out;
}

at::Tensor ggml_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t type,
                       const c10::optional<at::Tensor>& bias, int64_t gemv_max_rows) {
  const int64_t K = ggml_columns(blocks, type);
  check_quant_operands(x, blocks, K, bias);
  const int64_t M = x.size(0), N = blocks.size(0);
  return float_product(x, N, [&](auto tag, at::Tensor& out) {
    using T = decltype(tag);
    kvflow::ggml_linear<T>(ptr<T>(x), M, K, x.stride(0), ptr<uint8_t>(blocks), N, static_cast<int>(type),
                           bias ? ptr<float>(*bias) : nullptr, ptr<float>(out), gemv_max_rows,
                           at::get_num_threads());
  });
}

std::tuple<at::Tensor, at::Tensor> ggml_quantize_activations(const at::Tensor& x, int64_t type) {
  TORCH_CHECK(type >= kvflow::kGgmlQ8_0 && type <= kvflow::kGgmlQ6_K, "unknown GGML type code ", type);
  const int64_t block = kvflow::ggml_activation_block(static_cast<int>(type));
  TORCH_CHECK(block > 0, "GGML type ", type, " keeps float activations");
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % block == 0,
              "x must be 2-D [M, a multiple of ", block, "] with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor quants = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({M, K / block}, x.options().dtype(at::kFloat));
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    kvflow::ggml_quantize_activations<T>(ptr<T>(x), M, K, x.stride(0), static_cast<int>(type),
                                         ptr<int8_t>(quants), ptr<float>(scales));
  });
  return {quants, scales};
}

at::Tensor ggml_linear_w8a8(const at::Tensor& x, const at::Tensor& blocks, int64_t type,
                            const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(kvflow::has_w8a8_kernels(), "ggml_linear_w8a8 needs an AVX-512 VNNI build");
  TORCH_CHECK(type == kvflow::kGgmlQ8_0, "ggml_linear_w8a8 takes Q8_0 blocks");
  const int64_t K = ggml_columns(blocks, type);
  check_quant_operands(x, blocks, K, bias);
  const int64_t M = x.size(0), N = blocks.size(0);
  return float_product(x, N, [&](auto tag, at::Tensor& out) {
    using T = decltype(tag);
    kvflow::ggml_linear_w8a8<T>(ptr<T>(x), M, K, x.stride(0), ptr<uint8_t>(blocks), N, static_cast<int>(type),
                                bias ? ptr<float>(*bias) : nullptr, ptr<float>(out), at::get_num_threads());
  });
}

// qweight int8 [N, K] with a float32 scale per row, and x / bias as check_quant_operands wants them; returns K.
int64_t check_int8_operands(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                            const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(qweight.scalar_type() == at::kChar, "qweight must be int8");
  const int64_t K = qweight.dim() == 2 ? qweight.size(1) : -1;
  check_quant_operands(x, qweight, K, bias);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == qweight.size(0),
              "scale must be contiguous float32 [N]");
  return K;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias, int64_t gemv_max_rows) {
  const int64_t K = check_int8_operands(x, qweight, scale, bias);
  const int64_t M = x.size(0), N = qweight.size(0);
  return float_product(x, N, [&](auto tag, at::Tensor& out) {
    using T = decltype(tag);
    kvflow::int8_linear<T>(ptr<T>(x), M, K, x.stride(0), ptr<int8_t>(qweight), ptr<float>(scale), N,
                           bias ? ptr<float>(*bias) : nullptr, ptr<float>(out), gemv_max_rows,
                           at::get_num_threads());
  });
}

at::Tensor int8_linear_amx(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                           const c10::optional<at::Tensor>& bias, bool emulated) {
  TORCH_CHECK(emulated || kvflow::amx_usable(), "int8_linear_amx: this CPU (or process) cannot use AMX tiles");
  const int64_t K = check_int8_operands(x, qweight, scale, bias);
  const int64_t M = x.size(0), N = qweight.size(0);
  return float_product(x, N, [&](auto tag, at::Tensor& out) {
    using T = decltype(tag);
    kvflow::int8_linear_amx<T>(ptr<T>(x), M, K, x.stride(0), ptr<int8_t>(qweight), ptr<float>(scale), N,
                               bias ? ptr<float>(*bias) : nullptr, ptr<float>(out), emulated, at::get_num_threads());
  });
}

// One stacked quantized expert weight for quant_fused_moe: GGUF blocks (uint8 [E, N, row_bytes]) or int8
// [E, N, K] with float32 scales [E, N]; returns the scale pointer (nullptr for GGUF types).
const float* check_expert_weight(const at::Tensor& w, int64_t type, const c10::optional<at::Tensor>& scale,
                                 int64_t experts, int64_t N, int64_t K, const char* name) {
  TORCH_CHECK(w.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() && w.size(0) == experts && w.size(1) == N, name,
              " must be contiguous [", experts, ", ", N, ", ...]");
  if (type == kvflow::kInt8Weights) {
    TORCH_CHECK(w.scalar_type() == at::kChar && w.size(2) == K, name, " must be int8 [E, ", N, ", ", K, "]");
    TORCH_CHECK(scale && scale->scalar_type() == at::kFloat && scale->is_contiguous() &&
                    scale->numel() == experts * N,
                name, "'s scale must be contiguous float32 [E, ", N, "]");
    return ptr<float>(*scale);
  }
  TORCH_CHECK(type >= kvflow::kGgmlQ8_0 && type <= kvflow::kGgmlQ6_K, "unknown GGML type code ", type);
  const int64_t elements = kvflow::ggml_block_elements(static_cast<int>(type));
  TORCH_CHECK(w.scalar_type() == at::kByte && K % elements == 0 &&
                  w.size(2) == K / elements * kvflow::ggml_block_bytes(static_cast<int>(type)),
              name, " must be uint8 blocks [E, ", N, ", row bytes of ", K, " columns]");
  return nullptr;
}

// x [T, H] with contiguous rows; w13 [E, 2I, ...] and w2 [E, H, ...] quantized (check_expert_weight);
// topk_weights float32 and topk_ids int64, both contiguous [T, k]; out in x's dtype.
at::Tensor quant_fused_moe(const at::Tensor& x, const at::Tensor& w13, int64_t w13_type,
                           const c10::optional<at::Tensor>& w13_scale, const at::Tensor& w2, int64_t w2_type,
                           const c10::optional<at::Tensor>& w2_scale, const at::Tensor& topk_weights,
                           const at::Tensor& topk_ids, int64_t gemv_max_rows, int64_t tiled_max_rows) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be 2-D with contiguous rows");
  TORCH_CHECK(w13.dim() == 3 && w13.size(1) % 2 == 0, "w13 must be [E, 2 * I, ...]");
  const int64_t tokens = x.size(0), hidden = x.size(1), num_experts = w13.size(0), intermediate = w13.size(1) / 2;
  const float* s13 = check_expert_weight(w13, w13_type, w13_scale, num_experts, 2 * intermediate, hidden, "w13");
  const float* s2 = check_expert_weight(w2, w2_type, w2_scale, num_experts, hidden, intermediate, "w2");
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat && topk_weights.is_contiguous() && topk_weights.dim() == 2 &&
                  topk_weights.size(0) == tokens,
              "topk_weights must be contiguous float32 [tokens, k]");
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong && topk_ids.is_contiguous() &&
                  topk_ids.sizes() == topk_weights.sizes(),
              "topk_ids must be contiguous int64 of topk_weights' shape");
  at::Tensor out = at::empty({tokens, hidden}, x.options());
  bool ok = true;
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    ok = kvflow::quant_fused_moe<T>(ptr<T>(x), tokens, hidden, x.stride(0), ptr<uint8_t>(w13), s13,
                                    static_cast<int>(w13_type), ptr<uint8_t>(w2), s2, static_cast<int>(w2_type),
                                    num_experts, intermediate, ptr<float>(topk_weights), ptr<int64_t>(topk_ids),
                                    topk_ids.size(1), gemv_max_rows, tiled_max_rows, ptr<T>(out),
                                    at::get_num_threads());
  });
  TORCH_CHECK(ok, "topk_ids must lie in [0, ", num_experts, ")");
  return out;
}

// y [n, out] and x [n, in] (contiguous rows, one dtype); lora_a [num_slots, num_parts * rank, in] and lora_b
// [num_slots, out, rank] contiguous, x's dtype; token_slots int32 [n] contiguous (-1: no adapter); part_offsets
// 0 = p[0] < ... < p[num_parts] = out. Adds each row's LoRA delta to y in place (kvflow::lora_add).
// `shrink`: "" (default_lora_shrink()), "widened_fp32" or "avx512_bf16" (kvflow::LoraShrink's order).
const char* const kLoraShrinkNames[] = {"widened_fp32", "avx512_bf16"};

kvflow::LoraShrink lora_shrink_named(const std::string& name) {
  if (name.empty()) return kvflow::default_lora_shrink();
  for (int i = 0; i < static_cast<int>(std::size(kLoraShrinkNames)); ++i)
    if (name == kLoraShrinkNames[i]) {
      const auto shrink = static_cast<kvflow::LoraShrink>(i);
      TORCH_CHECK(kvflow::lora_shrink_available(shrink), "shrink ", name, " needs an AVX-512 x86-64 build");
      return shrink;
    }
  TORCH_CHECK(false, "shrink must be one of widened_fp32, avx512_bf16 (or empty: the default); got '", name, "'");
}

void lora_add(const at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
              const at::Tensor& token_slots, const std::vector<int64_t>& part_offsets, const std::string& shrink) {
  const kvflow::LoraShrink shrink_kind = lora_shrink_named(shrink);
  check_cpu(y, "y");
  for (const auto& [operand, name] : {std::pair<const at::Tensor&, const char*>{x, "x"}, {lora_a, "lora_a"},
                                      {lora_b, "lora_b"}}) {
    TORCH_CHECK(operand.device().is_cpu(), name, " must be a CPU tensor");
    check_same_dtype(operand, y, name);
  }
  TORCH_CHECK(y.dim() == 2 && y.stride(1) == 1, "y must be 2-D [n, out] with contiguous rows");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(0) == y.size(0),
              "x must be 2-D [n, in] with contiguous rows and y's n = ", y.size(0));
  const int64_t n = y.size(0), in = x.size(1), out = y.size(1);
  TORCH_CHECK(lora_b.dim() == 3 && lora_b.is_contiguous() && lora_b.size(1) == out,
              "lora_b must be contiguous [num_slots, out = ", out, ", rank]");
  const int64_t num_slots = lora_b.size(0), rank = lora_b.size(2);
  const int64_t num_parts = static_cast<int64_t>(part_offsets.size()) - 1;
  TORCH_CHECK(num_parts >= 1 && part_offsets.front() == 0 && part_offsets.back() == out,
              "part_offsets must run from 0 to out = ", out);
  for (int64_t p = 0; p < num_parts; ++p)
    TORCH_CHECK(part_offsets[p] < part_offsets[p + 1], "part_offsets must be strictly increasing");
  TORCH_CHECK(lora_a.dim() == 3 && lora_a.is_contiguous() && lora_a.size(0) == num_slots &&
                  lora_a.size(1) == num_parts * rank && lora_a.size(2) == in,
              "lora_a must be contiguous [num_slots = ", num_slots, ", num_parts * rank = ", num_parts * rank,
              ", in = ", in, "]");
  TORCH_CHECK(token_slots.device().is_cpu() && token_slots.scalar_type() == at::kInt && token_slots.dim() == 1 &&
                  token_slots.is_contiguous() && token_slots.size(0) == n,
              "token_slots must be a contiguous int32 CPU tensor [n = ", n, "]");
  bool ok = true;
  dispatch(y, [&](auto tag) {
    using T = decltype(tag);
    ok = kvflow::lora_add<T>(ptr<T>(y), y.stride(0), ptr<T>(x), x.stride(0), n, in, out, ptr<T>(lora_a),
                             ptr<T>(lora_b), num_slots, rank, ptr<int32_t>(token_slots), part_offsets.data(),
                             num_parts, shrink_kind, at::get_num_threads());
  });
  TORCH_CHECK(ok, "token_slots must lie in [-1, num_slots = ", num_slots, ")");
}

// query / key / value [tokens, heads, head_dim] (head_dim contiguous; one token stride and head stride for the
// three, as views of one qkv product have), cu_seqlens int64 [num_seqs + 1] from 0 to tokens: bidirectional
// attention within each sequence, out [tokens, heads * head_dim]; None where the kernel does not apply
// (encoder_attention.h).
c10::optional<at::Tensor> varlen_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                           const at::Tensor& cu_seqlens, double scale) {
  check_cpu(query, "query");
  check_same_dtype(key, query, "key");
  check_same_dtype(value, query, "value");
  TORCH_CHECK(query.dim() == 3 && key.sizes() == query.sizes() && value.sizes() == query.sizes(),
              "query, key and value must be [tokens, heads, head_dim] of one shape");
  TORCH_CHECK(query.stride(2) == 1 && key.strides() == query.strides() && value.strides() == query.strides(),
              "query, key and value must share their strides, head_dim contiguous");
  TORCH_CHECK(cu_seqlens.device().is_cpu() && cu_seqlens.scalar_type() == at::kLong && cu_seqlens.dim() == 1 &&
                  cu_seqlens.is_contiguous() && cu_seqlens.numel() >= 1,
              "cu_seqlens must be a contiguous int64 CPU tensor [num_seqs + 1]");
  const int64_t tokens = query.size(0), heads = query.size(1), head_dim = query.size(2);
  const int64_t num_seqs = cu_seqlens.numel() - 1;
  const int64_t* bounds = cu_seqlens.data_ptr<int64_t>();
  TORCH_CHECK(bounds[0] == 0 && bounds[num_seqs] == tokens, "cu_seqlens must run from 0 to tokens = ", tokens);
  for (int64_t s = 0; s < num_seqs; ++s)
    TORCH_CHECK(bounds[s] <= bounds[s + 1], "cu_seqlens must not decrease");
  at::Tensor out = at::empty({tokens, heads * head_dim}, query.options());
  bool ran = false;
  dispatch(query, [&](auto tag) {
    using T = decltype(tag);
    ran = kvflow::varlen_attention<T>(ptr<T>(query), ptr<T>(key), ptr<T>(value), query.stride(0), query.stride(1),
                                      bounds, num_seqs, heads, head_dim, static_cast<float>(scale), ptr<T>(out),
                                      at::get_num_threads());
  });
  if (!ran) return c10::nullopt;
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvflow CPU kernels (decode GEMV, prefill GEMM, fused elementwise ops, paged decode attention)";
  m.def("linear", &linear, "x @ weight.T (+ bias) for small M", py::arg("x"), py::arg("weight"), py::arg("bias"),
        py::arg("float_output") = false);
  m.def("gemm", &gemm, "x @ weight.T (+ bias) for bfloat16 and M > 8, on the kernel gemm_kernel() names",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("float_output") = false);
  m.def("gemm_with", &gemm_with,
        "gemm on a named kernel (widened_fp32, avx512_bf16, amx_bf16, amx_bf16_emulated): tests and benchmarks",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("float_output"), py::arg("kernel"));
  m.def("gemm_kernel", []() { return gemm_kernel_name(kvflow::gemm_kernel()); },
        "the kernel gemm runs on now");
  m.def("default_gemm_kernel",
        []() { return gemm_kernel_name(kvflow::default_gemm_kernel()); },
        "the kernel gemm runs on this CPU unless set_gemm_kernel chose another");
  m.def("set_gemm_kernel", [](const std::string& name) { kvflow::set_gemm_kernel(gemm_kernel_named(name)); },
        "the kernel gemm runs on from now on (the caller checked the CPU can run it)", py::arg("kernel"));
  m.def("amx_usable", []() { return kvflow::amx_usable(); },
        "AMX tiles in CPUID and the tile data permission granted to this process");
  m.def("cpu_has_avx512_bf16", []() { return kvflow::cpu_has_avx512_bf16(); }, "AVX512_BF16 in CPUID");
  m.def("avx512_bf16_probe", &kvflow::avx512_bf16_probe,
        "one vdpbf16ps (returns 32.0); SIGILL where the CPU cannot execute it: call it in a child process");
  m.def("int8_linear_amx", &int8_linear_amx,
        "int8_linear's W8A8 product on AMX tiles (emulated: the scalar tile emulation, any CPU)", py::arg("x"),
        py::arg("qweight"), py::arg("scale"), py::arg("bias"), py::arg("emulated"));
  m.def("stream_read", &stream_read, "read a uint8 buffer once (the memory-read floor)");
  m.def("add_rms_norm", &add_rms_norm, "(rms_norm(x + residual), x + residual)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("fused_moe", &fused_moe,
        "a mixture-of-experts layer's experts: tokens grouped per expert, gate_up, silu * up, down, weighted sum",
        py::arg("x"), py::arg("w13"), py::arg("w2"), py::arg("topk_weights"), py::arg("topk_ids"),
        py::arg("gemm") = false);
  m.def("quant_fused_moe", &quant_fused_moe, "fused_moe on quantized experts (GGUF blocks or int8 rows)",
        py::arg("x"), py::arg("w13"), py::arg("w13_type"), py::arg("w13_scale"), py::arg("w2"), py::arg("w2_type"),
        py::arg("w2_scale"), py::arg("topk_weights"), py::arg("topk_ids"), py::arg("gemv_max_rows"),
        py::arg("tiled_max_rows"));
  m.def("lora_add", &lora_add, "y[i] += B[slot] @ (A[slot] @ x[i]) per part, in place (rows with slot -1 untouched)",
        py::arg("y"), py::arg("x"), py::arg("lora_a"), py::arg("lora_b"), py::arg("token_slots"),
        py::arg("part_offsets"), py::arg("shrink") = "");
  m.def("default_lora_shrink",
        []() { return std::string(kLoraShrinkNames[static_cast<int>(kvflow::default_lora_shrink())]); },
        "the bfloat16 shrink product lora_add runs on by default: widened_fp32 or avx512_bf16");
  m.def("rotary", &rotary, "neox rotary embedding into a new contiguous tensor");
  m.def("paged_attention", &paged_attention,
        "attention over the paged KV cache (rows of query tokens, sliding window, logit soft-capping)");
  m.def("store_kv", &store_kv, "write the step's K/V into the paged cache at slot_mapping");
  m.def("decode_layer", &decode_layer, "one decoder layer of a decode-only step (returns out, residual)",
        py::arg("hidden"), py::arg("residual"), py::arg("input_norm"), py::arg("post_norm"), py::arg("q_norm"),
        py::arg("k_norm"), py::arg("qkv"), py::arg("qkv_bias"), py::arg("o"), py::arg("o_bias"), py::arg("gate_up"),
        py::arg("gate_up_bias"), py::arg("down"), py::arg("down_bias"), py::arg("cos"), py::arg("sin"),
        py::arg("kv_cache"), py::arg("layer"), py::arg("slot_mapping"), py::arg("block_tables"),
        py::arg("seq_lens"), py::arg("num_heads"), py::arg("eps"), py::arg("scale"), py::arg("window"),
        py::arg("gemv_max_rows"), py::arg("lora_token_slots") = py::none(),
        py::arg("lora_a") = std::vector<at::Tensor>{}, py::arg("lora_b") = std::vector<at::Tensor>{},
        py::arg("lora_part_offsets") = std::vector<std::vector<int64_t>>{});
  m.def("decode_layer_quantized", &decode_layer_quantized,
        "decode_layer on quantized weights (GGUF blocks or int8 runs; returns out, residual)", py::arg("hidden"),
        py::arg("residual"), py::arg("input_norm"), py::arg("post_norm"), py::arg("q_norm"), py::arg("k_norm"),
        py::arg("weights"), py::arg("types"), py::arg("scales"), py::arg("biases"), py::arg("gemv_max_rows"),
        py::arg("runs_per_product"), py::arg("intermediate"), py::arg("cos"), py::arg("sin"), py::arg("kv_cache"),
        py::arg("layer"), py::arg("slot_mapping"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("num_heads"), py::arg("eps"), py::arg("scale"), py::arg("window"),
        py::arg("lora_token_slots") = py::none(), py::arg("lora_a") = std::vector<at::Tensor>{},
        py::arg("lora_b") = std::vector<at::Tensor>{},
        py::arg("lora_part_offsets") = std::vector<std::vector<int64_t>>{});
  // module_local: each kernel build loaded in one process (benchmarks/kernel_build_ab.py) keeps its own class.
  py::class_<DecodeLayerStack>(m, "DecodeLayerStack", py::module_local(),
                               "a model's decoder layers for fused decode steps, checked once; run: one step")
      .def(py::init<at::ScalarType, int64_t, int64_t, int64_t, int64_t, double, double, int64_t>(), py::arg("dtype"),
           py::arg("hidden"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"),
           py::arg("scale"), py::arg("gemv_max_rows"))
      .def("add_dense_layer", &DecodeLayerStack::add_dense_layer, py::arg("input_norm"), py::arg("post_norm"),
           py::arg("q_norm"), py::arg("k_norm"), py::arg("qkv"), py::arg("qkv_bias"), py::arg("o"), py::arg("o_bias"),
           py::arg("gate_up"), py::arg("gate_up_bias"), py::arg("down"), py::arg("down_bias"),
           py::arg("window_group"))
      .def("add_quantized_layer", &DecodeLayerStack::add_quantized_layer, py::arg("input_norm"),
           py::arg("post_norm"), py::arg("q_norm"), py::arg("k_norm"), py::arg("weights"), py::arg("types"),
           py::arg("scales"), py::arg("biases"), py::arg("gemv_max_rows"), py::arg("runs_per_product"),
           py::arg("intermediate"), py::arg("window_group"))
      .def_property_readonly("num_layers", &DecodeLayerStack::num_layers)
      .def("run", &DecodeLayerStack::run, "every layer of a decode-only step (returns out, residual)",
           py::arg("hidden"), py::arg("cos"), py::arg("sin"), py::arg("kv_cache"), py::arg("slot_mapping"),
           py::arg("block_tables"), py::arg("seq_lens"), py::arg("windows"));
  m.def("ggml_dequantize", &ggml_dequantize, "GGUF blocks [rows, row_bytes] -> float32 [rows, columns]",
        py::arg("blocks"), py::arg("type"));
  m.def("ggml_linear", &ggml_linear, "x @ dequantize(blocks).T (+ bias), float32 out", py::arg("x"),
        py::arg("blocks"), py::arg("type"), py::arg("bias"), py::arg("gemv_max_rows"));
  m.def("ggml_quantize_activations", &ggml_quantize_activations,
        "x [M, K] -> (int8 quants [M, K], float32 scales [M, K / block]) as the Q4_0 / Q4_K / Q6_K products use",
        py::arg("x"), py::arg("type"));
  m.def("int8_linear", &int8_linear, "x @ (qweight * scale[:, None]).T (+ bias), float32 out", py::arg("x"),
        py::arg("qweight"), py::arg("scale"), py::arg("bias"), py::arg("gemv_max_rows"));
  // The most rows one decode_layer call takes: Python reads it here, so kernels.h stays the one source of truth.
  m.attr("MAX_DECODE_LAYER_ROWS") = py::int_(kvflow::kMaxDecodeLayerRows);
  m.def("has_avx2", []() {
#if (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)) || (defined(__AVX2__) && defined(__FMA__))
    return true;
#else
    return false;
#endif
  });
  m.def("ggml_linear_w8a8", &ggml_linear_w8a8,
        "x quantized per row @ dequantize(Q8_0 blocks).T (+ bias), float32 out (AVX-512 VNNI builds)",
        py::arg("x"), py::arg("blocks"), py::arg("type"), py::arg("bias"));
  // AVX-512 VNNI builds: int8_linear above gemv_max_rows quantizes x per row and multiplies integers (W8A8), and
  // ggml_linear_w8a8 exists.
  m.def("has_w8a8_kernels", &kvflow::has_w8a8_kernels);
  m.def("k_quant_interleaved_above_rows", &kvflow::k_quant_interleaved_above_rows);
  m.def("varlen_attention", &varlen_attention,
        "bidirectional attention within each packed sequence (encoders); None where the kernel does not apply",
        py::arg("query"), py::arg("key"), py::arg("value"), py::arg("cu_seqlens"), py::arg("scale"));
  m.def("varlen_attention_uses_dpbf16", &kvflow::varlen_attention_uses_dpbf16,
        "whether bfloat16 varlen_attention runs vdpbf16ps on this CPU");
  m.def("has_avx512", []() {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    return true;
#else
    return false;
#endif
  });
}
