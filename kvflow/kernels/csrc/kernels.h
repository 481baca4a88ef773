// Raw-pointer entry points of kvflow's CPU kernels (no torch headers: these sources compile in seconds).
// Each is instantiated for T = float and T = bf16 (uint16_t); bindings.cpp checks tensors and calls them.
#pragma once

#include <cstdint>

namespace kvflow {
using bf16 = uint16_t;  // bfloat16 bits
// Writes key[t, h, :] / value[t, h, :] (token and head strides given, head_dim contiguous) into the caches
// ([num_kv_heads, num_slots, head_dim] contiguous) at slot slot_mapping[t]. Returns false (writing nothing) when a
// slot is outside [0, num_slots).
template <typename T>
bool store_kv(const T* key, int64_t key_token_stride, int64_t key_head_stride, const T* value,
              int64_t value_token_stride, int64_t value_head_stride, const int64_t* slot_mapping, int64_t tokens, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots, T* key_cache, T* value_cache);

}  // namespace kvflow

namespace kvflow {

// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for m < M, fp32 accumulation, rounded once to T.
// x rows are `x_stride` elements apart; w is [N, K] row-major; y is [M, N] row-major (T), or, when `y_float` is
// given instead, the T-rounded results stored as float. Threads split the rows of w.
template <typename T>
void gemv(const T* x, int64_t M, int64_t K, int64_t x_stride, const T* w, int64_t N, const T* bias, T* y,
          float* y_float, int num_threads);

// Reads `num_bytes` (a multiple of 64) with `num_threads` threads and returns a checksum: the memory-read floor.
uint64_t stream_read(const uint8_t* data, int64_t num_bytes, int num_threads);

// residual_out = x + residual (rounded to T); out = weight * T(residual_out * rsqrt(mean(residual_out^2) + eps)).
// With residual == nullptr the sum is x itself (residual_out may then be nullptr). Rows are `hidden` contiguous.
template <typename T>
void add_rms_norm(const T* x, const T* residual, const T* weight, int64_t rows, int64_t hidden, float eps, T* out,
                  T* residual_out, int num_threads);

// out[r, i] = T(T(silu(gate[r, i])) * up[r, i]) with gate_up[r] = [gate (d) | up (d)], rows `in_stride` apart.
template <typename T>
void silu_and_mul(const T* gate_up, int64_t rows, int64_t d, int64_t in_stride, T* out, int num_threads);

// Neox-style rotary embedding of heads[t, h, :] (token stride `token_stride`, head stride `head_stride`, the
// head_dim contiguous) into out [tokens, heads, head_dim] contiguous, rounding each product and sum to T as the
// PyTorch expression does. cos/sin are [tokens, head_dim / 2] contiguous.
template <typename T>
void rotary(const T* heads, int64_t tokens, int64_t num_heads, int64_t head_dim, int64_t token_stride,
            int64_t head_stride, const T* cos, const T* sin, T* out, int num_threads);

// Paged attention reading K/V in place through block tables: row r has query_lens[r] query tokens (query_lens
// null: one each), flat tokens token_start[r] + i, the last at position seq_lens[r] - 1; token i at position p
// attends to positions [max(0, p + 1 - window), p + 1) (window 0: no window) of its sequence, whose blocks are
// block_tables[r * table_stride + b]. Scores are scale * q.k, soft-capped to tanh(score / softcap) * softcap when
// softcap > 0. Layouts as paged_decode_attention's; out[token, h, :] for every token of every row.
template <typename T>
void paged_attention(const T* query, int64_t q_token_stride, int64_t q_head_stride, const T* key_cache,
                     const T* value_cache, int64_t num_blocks, int64_t block_size, const int32_t* block_tables,
                     int64_t table_stride, const int32_t* seq_lens, const int64_t* token_start,
                     const int32_t* query_lens, int64_t rows, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_dim, float scale, int64_t window, float softcap, T* out, int num_threads);

// Decode attention (one query token per row) reading K/V in place through block tables.
// query[t, h, :] at query + t * q_token_stride + h * q_head_stride; key/value caches are
// [num_kv_heads, num_blocks, block_size, head_dim] contiguous; row r attends with the query token
// token_index[r] to positions [max(0, seq_len - window), seq_len) (window 0: no window) of its sequence, whose
// blocks are block_tables[r * table_stride + i]. Writes out[token_index[r], h, :] ([tokens, heads, head_dim]).
template <typename T>
void paged_decode_attention(const T* query, int64_t q_token_stride, int64_t q_head_stride, const T* key_cache,
                            const T* value_cache, int64_t num_blocks, int64_t block_size, const int32_t* block_tables,
                            int64_t table_stride, const int32_t* seq_lens, const int64_t* token_index, int64_t rows,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale, int64_t window,
                            T* out, int num_threads);

}  // namespace kvflow

namespace kvflow {

// Most rows decode_layer takes (its token index lives on the stack).
constexpr int64_t kMaxDecodeLayerRows = 64;

// Shapes and the step's paging of one decode_layer call. Every row is a decode row (one query token, sampled).
struct DecodeLayerParams {
  int64_t rows, hidden, intermediate, num_heads, num_kv_heads, head_dim;
  float eps, scale;
  int64_t window;  // 0: no sliding window
  int64_t num_blocks, block_size;
  const int64_t* slot_mapping;  // [rows]
  const int32_t* block_tables;  // [rows, table_stride]
  int64_t table_stride;
  const int32_t* seq_lens;  // [rows], counting this step's token
  int64_t gemv_max_rows;     // above it (bf16) the products run on the GEMM, as kernels.linear dispatches
  // LoRA: each row's adapter slot (-1: none) for the products that carry a LoraProduct; nullptr: no adapter rows.
  const int32_t* lora_token_slots = nullptr;
  int64_t qkv_width() const;
  int64_t workspace_elements() const;
  // float32 scratch a quantized product needs (its widest output, M rows); 0 for dense weights
  int64_t quant_scratch_elements() const;
};

// A quantized weight's run of output rows (quant_linear.cpp's products): GGUF blocks of `type` ([rows,
// row_bytes]), or, with type kInt8Weights, int8 [rows, K] with a float32 scale per row. `bias` (float32 [rows]) may
// be nullptr. The run's product is ggml_linear / int8_linear with `gemv_max_rows`, the value the per-op path
// (kvflow/kernels/quant.py) passes for the same rows.
constexpr int kInt8Weights = -1;
constexpr int kMaxProductRuns = 3;  // q, k, v: the most shards a fused layer has
struct QuantRun {
  const void* weight;
  int type;
  int64_t rows;
  const float* scale;  // kInt8Weights only
  const float* bias;
  int64_t gemv_max_rows;
};

// One linear layer's weight for decode_layer: dense (row-major [out, in] T, `bias` T or nullptr), or quantized:
// `num_runs` runs whose outputs, each rounded to T, are concatenated in order (as the per-op path's torch.cat).
// A product's LoRA adapter slots as lora_add takes them (a = nullptr: none): after the base product, rows with a
// slot get lora_add's delta, on the default shrink, so the fused layer equals the per-op layer plus its deltas.
template <typename T>
struct LoraProduct {
  const T* a = nullptr;  // [num_slots, num_parts * rank, K]
  const T* b = nullptr;  // [num_slots, N, rank]
  int64_t num_slots = 0, rank = 0, num_parts = 0;
  int64_t part_offsets[kMaxProductRuns + 1] = {};
};

template <typename T>
struct LayerProduct {
  const T* dense = nullptr;
  const T* bias = nullptr;
  int num_runs = 0;
  QuantRun runs[kMaxProductRuns] = {};
  LoraProduct<T> lora;
};

// One layer's weights. `q_norm` / `k_norm` ([head_dim] each, both or neither; Qwen3): each query and key head is
// RMS-normalised with them (add_rms_norm's numerics, eps as the layer norms') after the QKV product, before rotary.
template <typename T>
struct DecodeLayerWeights {
  const T* input_norm;
  const T* post_norm;
  LayerProduct<T> qkv, o, gate_up, down;
  const T* q_norm = nullptr;
  const T* k_norm = nullptr;
};

// out = the layer's MLP output, residual_out = the residual stream after attention (their sum is the layer's
// hidden state); residual nullptr for the first layer. Writes the rows' K/V into the caches
// ([num_kv_heads, num_blocks, block_size, head_dim]). Returns false (the caches untouched) when a slot is out of
// range. rows <= kMaxDecodeLayerRows. `quant_scratch` (quant_scratch_elements() floats) may be nullptr when every
// product is dense.
template <typename T>
bool decode_layer(const DecodeLayerParams& params, const DecodeLayerWeights<T>& weights, const T* hidden,
                  const T* residual, const T* cos, const T* sin, T* key_cache, T* value_cache, T* workspace, T* out,
                  T* residual_out, float* quant_scratch, int num_threads);

// The same product as gemv for bf16 (y = x w^T (+ bias), fp32 accumulation, rounded once), blocked for M > 8 so
// that each weight block is read once for every row of x. Threads split w's rows. It runs on gemm_kernel().
void gemm(const bf16* x, int64_t M, int64_t K, int64_t x_stride, const bf16* w, int64_t N, const bf16* bias, bf16* y,
          float* y_float, int num_threads);

// y [M, N] = x w^T for float32 on the widened-fp32 kernel's blocking (the weights read in place, not widened;
// the portable build: gemv). Each element's summation order depends on K only, not on M or the threads.
void gemm_float32(const float* x, int64_t M, int64_t K, int64_t x_stride, const float* w, int64_t N, float* y,
                  int num_threads);

// gemm's kernels. kWidenedFp32: fp32 FMAs on weights widened in cache-sized blocks (any AVX-512 build);
// kAvx512Bf16: vdpbf16ps on the bf16 weights in place (gemm.cpp); kAmxBf16: AMX tiles (amx.cpp);
// kAmxBf16Emulated: the AMX kernel on the scalar tile emulation (tests, any CPU). Calling a kernel the CPU lacks
// (see cpu_features.h) faults: gemm_with is for tests and benchmarks that checked.
enum class GemmKernel : int { kWidenedFp32 = 0, kAvx512Bf16 = 1, kAmxBf16 = 2, kAmxBf16Emulated = 3 };
// kAmxBf16 where AMX is usable, else kAvx512Bf16 on AMD CPUs with AVX512_BF16, else kWidenedFp32.
GemmKernel default_gemm_kernel();
// The kernel gemm (and decode_layer's dense products) run on: default_gemm_kernel() until set_gemm_kernel
// (kvflow.kernels applies KVFLOW_BF16_GEMM through it, after checking the CPU can run the choice).
GemmKernel gemm_kernel();
void set_gemm_kernel(GemmKernel kernel);
// One vdpbf16ps (32 products of ones: returns 32.0); faults where the CPU cannot execute it. Tests call it in a
// child process to learn whether the kAvx512Bf16 kernel can run here even where CPUID hides the flag.
float avx512_bf16_probe();
void gemm_with(GemmKernel kernel, const bf16* x, int64_t M, int64_t K, int64_t x_stride, const bf16* w, int64_t N,
               const bf16* bias, bf16* y, float* y_float, int num_threads);

// AMX tile products (amx.cpp; `emulated`: the scalar tile emulation, on any CPU). x86-64 builds only.
// y (bf16, or the bf16-rounded values as float in y_float) = x w^T (+ bias), fp32 tile sums over the whole K.
void amx_gemm_bf16(const bf16* x, int64_t M, int64_t K, int64_t x_stride, const bf16* w, int64_t N, const bf16* bias,
                   bf16* y, float* y_float, bool emulated, int num_threads);
// y[m, n] = float(dot(quants[m], w[n])) * (x_scales[m] * w_scales[n]) + bias[n] (bias may be nullptr): the int8
// weights [N, K] against x quantized per row (quants [M, K] contiguous), the dots exact int32 (TDPBSSD).
void amx_int8_product(const int8_t* quants, int64_t M, int64_t K, const float* x_scales, const int8_t* w,
                      const float* w_scales, int64_t N, const float* bias, float* y, bool emulated, int num_threads);

}  // namespace kvflow

namespace kvflow {

// Quantized weights (quant_*.cpp). GGUF block types, as kvflow/kernels/quant.py's _GGML_TYPE_CODES numbers them.
enum GgmlType : int { kGgmlQ8_0 = 0, kGgmlQ4_0 = 1, kGgmlQ4_K = 2, kGgmlQ6_K = 3 };
int64_t ggml_block_elements(int type);
int64_t ggml_block_bytes(int type);

// out [rows, columns] float32 = the rows of blocks ([rows, row_bytes], whole blocks) decoded exactly as
// gguf.quants.dequantize does. Threads split the rows.
void ggml_dequantize(const uint8_t* blocks, int64_t rows, int64_t row_bytes, int type, float* out, int num_threads);

// y [M, N] float32 = x [M, K] (rows x_stride apart; quantized as below where ggml_activation_block(type) > 0) times
// the dequantized weight [N, K] (+ bias [N] float32 or nullptr), fp32 accumulation. M <= gemv_max_rows: the
// products on the blocks (on quantized x: integer dots); more: the tiled kernel (quant_linear.cpp says which when).
template <typename T>
void ggml_linear(const T* x, int64_t M, int64_t K, int64_t x_stride, const uint8_t* w, int64_t N, int type,
                 const float* bias, float* y, int64_t gemv_max_rows, int num_threads);

// Q4_0, Q4_K and Q6_K products quantize x as llama.cpp does, per block of ggml_activation_block(type) columns
// (32, 256, 256), and Q8_0 per 32 unless q8_0_int8_activations() is false (then 0: fp32 x): d = amax / 127,
// q = round-half-even(x / d) (0 when d = 0). ggml_quantize_activations writes quants [M, K] and scales
// [M, K / block] (x rows x_stride apart).
int64_t ggml_activation_block(int type);
// Q8_0 products' activations, from the environment at each call: KVFLOW_Q8_0_ACTIVATIONS "int8" (or unset / empty,
// the default: x quantized per 32 columns, integer dots) or "float32" (fp32 x: exactly the dequantized float32
// model's products); std::invalid_argument naming the variable for another value.
constexpr const char* kQ8_0ActivationsEnv = "KVFLOW_Q8_0_ACTIVATIONS";
bool q8_0_int8_activations();
template <typename T>
void ggml_quantize_activations(const T* x, int64_t M, int64_t K, int64_t x_stride, int type, int8_t* quants,
                               float* scales);

// The same for int8 weights [N, K] with a float32 scale per row: y = (x . q[n]) * scale[n] (+ bias[n]).
template <typename T>
void int8_linear(const T* x, int64_t M, int64_t K, int64_t x_stride, const int8_t* w, const float* scale, int64_t N,
                 const float* bias, float* y, int64_t gemv_max_rows, int num_threads);

// int8_linear's W8A8 product on AMX tiles for any M (`emulated`: the scalar tile emulation): above gemv_max_rows
// int8_linear takes it where AMX is usable (cpu_features.h), equal to the VNNI product bit for bit.
template <typename T>
void int8_linear_amx(const T* x, int64_t M, int64_t K, int64_t x_stride, const int8_t* w, const float* scale,
                     int64_t N, const float* bias, float* y, bool emulated, int num_threads);

// Q8_0 weights (type) against x quantized per row (W8A8: d_x = amax / 127 per row, exact int32 dots per
// block, scaled by d_b and d_x in fp32), for prefill-sized M; only on AVX-512 VNNI builds (has_w8a8_kernels),
// where int8_linear above gemv_max_rows takes the same per-row W8A8 form.
template <typename T>
void ggml_linear_w8a8(const T* x, int64_t M, int64_t K, int64_t x_stride, const uint8_t* w, int64_t N, int type,
                      const float* bias, float* y, int num_threads);
bool has_w8a8_kernels();
// Above this many x rows (AVX-512 VNNI builds) ggml_linear's Q4_0, Q4_K and Q6_K integer products run on
// interleaved 16-row weight tiles: the same int8 activations and integers, summed in another order than the
// GEMV's; -1 on other builds.
int64_t k_quant_interleaved_above_rows();

}  // namespace kvflow

namespace kvflow {

// The product each expert's gate_up and down run on in fused_moe: kGemv, the GEMV kernel (gemv, any M); kGemm,
// gemm (bf16, on gemm_kernel()) or gemm_float32. One kernel for every group size keeps a token's result
// batch-independent.
enum class MoeProduct : int { kGemv = 0, kGemm = 1 };

// The experts of a mixture-of-experts layer (fused_moe.cpp): out [tokens, hidden] = for each token, in ascending
// expert order over its top_k choices topk_ids[t, :] (int64 in [0, num_experts)) with weights topk_weights[t, :]
// (float32), the sum of T(weight * down_e(T(silu(gate_e(x))) * up_e(x))), each sum rounded to T. x rows are
// x_stride apart; w13 [num_experts, 2 * intermediate, hidden] (gate rows, then up rows) and w2
// [num_experts, hidden, intermediate] contiguous. Returns false (out untouched) when an id is out of range.
template <typename T>
bool fused_moe(const T* x, int64_t tokens, int64_t hidden, int64_t x_stride, const T* w13, const T* w2,
               int64_t num_experts, int64_t intermediate, const float* topk_weights, const int64_t* topk_ids,
               int64_t top_k, MoeProduct product, T* out, int num_threads);

// fused_moe on quantized experts (quant_moe.cpp): w13 [num_experts, 2 * intermediate, hidden] and w2
// [num_experts, hidden, intermediate] as GGUF blocks of w13_type / w2_type (GgmlType: each matrix row whole
// blocks), or int8 (kInt8Weights) with float32 scales [num_experts, rows] (w13_scale / w2_scale; nullptr for GGUF
// types). Each expert's products run on the dense quantized product its token count picks (quant_moe.cpp says
// which: gemv_max_rows and tiled_max_rows as kvflow/kernels/quant.py's QUANT_GEMV_MAX_ROWS /
// QUANT_TILED_MAX_ROWS); results are weighted and summed in fp32, rounded to T once. Returns false (out untouched)
// when an id is out of range.
template <typename T>
bool quant_fused_moe(const T* x, int64_t tokens, int64_t hidden, int64_t x_stride, const uint8_t* w13,
                     const float* w13_scale, int w13_type, const uint8_t* w2, const float* w2_scale, int w2_type,
                     int64_t num_experts, int64_t intermediate, const float* topk_weights, const int64_t* topk_ids,
                     int64_t top_k, int64_t gemv_max_rows, int64_t tiled_max_rows, T* out, int num_threads);

}  // namespace kvflow

namespace kvflow {

// Batched LoRA deltas (lora.cpp; punica's bgmv / sgmv): for every row i < n with slot s = token_slots[i] >= 0 and
// every part p < num_parts (output rows [part_offsets[p], part_offsets[p + 1]), part_offsets[num_parts] = out),
// t = lora_a[s, p * rank .. (p + 1) * rank) @ x[i] in float32 and y[i, part] = T(float(y[i, part]) +
// lora_b[s, part, :] @ t), one rounding. lora_a [num_slots, num_parts * rank, in] and lora_b [num_slots, out, rank]
// contiguous; x and y rows x_stride / y_stride apart. Rows with slot -1 are untouched. A row's result depends on
// its own x, slot and y only (bitwise, any batch, any thread count). Returns false (y untouched) when a slot lies
// outside [-1, num_slots). `shrink` picks the bf16 A @ x product (float32 always widens).
// kWidenedFp32: fp32 FMAs on widened bf16 (the portable build's order, bitwise); kAvx512Bf16: vdpbf16ps (AVX-512
// builds; the caller checked the CPU executes it). One kind for every call keeps rows batch-independent.
enum class LoraShrink : int { kWidenedFp32 = 0, kAvx512Bf16 = 1 };
LoraShrink default_lora_shrink();
bool lora_shrink_available(LoraShrink shrink);  // compiled into this build
template <typename T>
bool lora_add(T* y, int64_t y_stride, const T* x, int64_t x_stride, int64_t n, int64_t in, int64_t out,
              const T* lora_a, const T* lora_b, int64_t num_slots, int64_t rank, const int32_t* token_slots,
              const int64_t* part_offsets, int64_t num_parts, LoraShrink shrink, int num_threads);

}  // namespace kvflow
