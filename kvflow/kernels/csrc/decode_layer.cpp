// One Llama-family decoder layer for a decode-only step of up to kMaxDecodeLayerRows rows, in one call from Python.
// It chains the same raw kernels the layer's Python code calls one by one (add+RMSNorm, QKV GEMV, the per-head q/k
// RMSNorm where the model has one (Qwen3), RoPE, K/V store, paged decode attention, o GEMV, add+RMSNorm, gate/up
// GEMV, SiLU-and-mul, down GEMV) in the same order with the same roundings, so its results equal that path bit for bit; what it saves is ~30 Python-level tensor ops and
// views per layer. Intermediates live in a caller-provided workspace (DecodeLayerParams::workspace_elements).
// Quantized weights (GGUF blocks, int8) run the very products kvflow/kernels/quant.py calls for the same rows.
#include <algorithm>
#include <type_traits>

#include "common.h"
#include "kernels.h"

namespace kvflow {
namespace {

// A dense product as kernels.linear picks it for M rows: the GEMV up to `gemv_max_rows`, else the blocked GEMM
// (bf16).
template <typename T>
void dense_product(const DecodeLayerParams& p, const T* x, int64_t K, const T* w, int64_t N, const T* bias, T* y,
                   int num_threads) {
  if constexpr (std::is_same_v<T, bf16>) {
    if (p.rows > p.gemv_max_rows) {
      gemm(x, p.rows, K, K, w, N, bias, y, nullptr, num_threads);
      return;
    }
  }
  gemv<T>(x, p.rows, K, K, w, N, bias, y, nullptr, num_threads);
}

// y [M, N] = x times the layer's weight, dense or quantized. A quantized run's product is the kernel the per-op
// path (kvflow/kernels/quant.py) calls for M rows, into float32 scratch, then rounded to T into its columns of y.
template <typename T>
void base_product(const DecodeLayerParams& p, const T* x, int64_t K, const LayerProduct<T>& w, int64_t N, T* y,
                  float* scratch, int num_threads) {
  if (w.dense != nullptr) {
    dense_product<T>(p, x, K, w.dense, N, w.bias, y, num_threads);
    return;
  }
  const int64_t M = p.rows;
  int64_t column = 0;
  for (int r = 0; r < w.num_runs; ++r) {
    const QuantRun& run = w.runs[r];
    if (run.type == kInt8Weights) {
      int8_linear<T>(x, M, K, K, static_cast<const int8_t*>(run.weight), run.scale, run.rows, run.bias, scratch,
                     run.gemv_max_rows, num_threads);
    } else {
      ggml_linear<T>(x, M, K, K, static_cast<const uint8_t*>(run.weight), run.rows, run.type, run.bias, scratch,
                     run.gemv_max_rows, num_threads);
    }
    for (int64_t m = 0; m < M; ++m) {
      const float* source = scratch + m * run.rows;
      T* target = y + m * N + column;
      for (int64_t n = 0; n < run.rows; ++n) target[n] = from_float<T>(source[n]);
    }
    column += run.rows;
  }
}

// The base product, then (with adapter rows in the step) each adapter row's LoRA delta, as the per-op layer adds
// it after its product (the binding checked the slots, so lora_add cannot refuse them).
template <typename T>
void product(const DecodeLayerParams& p, const T* x, int64_t K, const LayerProduct<T>& w, int64_t N, T* y,
             float* scratch, int num_threads) {
  base_product<T>(p, x, K, w, N, y, scratch, num_threads);
  const LoraProduct<T>& lora = w.lora;
  if (p.lora_token_slots != nullptr && lora.a != nullptr)
    lora_add<T>(y, N, x, K, p.rows, K, N, lora.a, lora.b, lora.num_slots, lora.rank, p.lora_token_slots,
                lora.part_offsets, lora.num_parts, default_lora_shrink(), num_threads);
}

}  // namespace

int64_t DecodeLayerParams::qkv_width() const { return (num_heads + 2 * num_kv_heads) * head_dim; }

int64_t DecodeLayerParams::quant_scratch_elements() const {
  return rows * std::max({qkv_width(), hidden, 2 * intermediate});
}

int64_t DecodeLayerParams::workspace_elements() const {
  // residual sum, normed, qkv, rotated q/k, attention out, o, normed2, gate_up, act
  const int64_t per_row = 4 * hidden + qkv_width() + (num_heads + num_kv_heads) * head_dim +
                          num_heads * head_dim + 3 * intermediate;
  return rows * per_row;
}

template <typename T>
bool decode_layer(const DecodeLayerParams& p, const DecodeLayerWeights<T>& w, const T* hidden, const T* residual,
                  const T* cos, const T* sin, T* key_cache, T* value_cache, T* workspace, T* out,
                  T* residual_out, float* quant_scratch, int num_threads) {
  const int64_t M = p.rows, H = p.hidden, I = p.intermediate, hd = p.head_dim;
  const int64_t nh = p.num_heads, nkv = p.num_kv_heads, qkv_width = p.qkv_width();
  const int64_t rotated_width = (nh + nkv) * hd, attn_width = nh * hd;
  T* summed = workspace;  // hidden + residual (the residual stream after the first norm)
  T* normed = summed + M * H;
  T* qkv = normed + M * H;
  T* rotated = qkv + M * qkv_width;
  T* attn = rotated + M * rotated_width;
  T* o = attn + M * attn_width;
  T* normed2 = o + M * H;
  T* gate_up = normed2 + M * H;
  T* act = gate_up + M * 2 * I;

  // residual None (first layer): the stream is `hidden` itself.
  const T* stream = residual ? summed : hidden;
  add_rms_norm<T>(hidden, residual, w.input_norm, M, H, p.eps, normed, residual ? summed : nullptr, num_threads);
  product<T>(p, normed, H, w.qkv, qkv_width, qkv, quant_scratch, num_threads);
  if (w.q_norm != nullptr) {  // in place: a row's values are read before its outputs are written
    for (int64_t m = 0; m < M; ++m) {
      T* q = qkv + m * qkv_width;
      add_rms_norm<T>(q, nullptr, w.q_norm, nh, hd, p.eps, q, nullptr, 1);
      add_rms_norm<T>(q + nh * hd, nullptr, w.k_norm, nkv, hd, p.eps, q + nh * hd, nullptr, 1);
    }
  }
  rotary<T>(qkv, M, nh + nkv, hd, qkv_width, hd, cos, sin, rotated, num_threads);
  if (!store_kv<T>(rotated + nh * hd, rotated_width, hd, qkv + (nh + nkv) * hd, qkv_width, hd, p.slot_mapping, M,
                   nkv, hd, p.num_blocks * p.block_size, key_cache, value_cache))
    return false;
  int64_t token_index[kMaxDecodeLayerRows];
  for (int64_t r = 0; r < M; ++r) token_index[r] = r;
  paged_decode_attention<T>(rotated, rotated_width, hd, key_cache, value_cache, p.num_blocks, p.block_size,
                            p.block_tables, p.table_stride, p.seq_lens, token_index, M, nh, nkv, hd, p.scale,
                            p.window, attn, num_threads);
  product<T>(p, attn, attn_width, w.o, H, o, quant_scratch, num_threads);
  add_rms_norm<T>(o, stream, w.post_norm, M, H, p.eps, normed2, residual_out, num_threads);
  product<T>(p, normed2, H, w.gate_up, 2 * I, gate_up, quant_scratch, num_threads);
  silu_and_mul<T>(gate_up, M, I, 2 * I, act, num_threads);
  product<T>(p, act, I, w.down, H, out, quant_scratch, num_threads);
  return true;
}

template bool decode_layer<float>(const DecodeLayerParams&, const DecodeLayerWeights<float>&, const float*,
                                  const float*, const float*, const float*, float*, float*, float*, float*, float*,
                                  float*, int);
template bool decode_layer<bf16>(const DecodeLayerParams&, const DecodeLayerWeights<bf16>&, const bf16*, const bf16*,
                                 const bf16*, const bf16*, bf16*, bf16*, bf16*, bf16*, bf16*, float*, int);

}  // namespace kvflow
