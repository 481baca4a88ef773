// GGUF block layouts and their exact dequantization (Q8_0, Q4_0, Q4_K, Q6_K): the same float32 operations, in the
// same order, as gguf.quants.dequantize (and kvflow/kernels/quant.py's dequantize_reference), so the floats are
// identical; -ffp-contract=off keeps `step * q - offset` from being fused. Also the portable GEMV that builds
// without AVX2 + FMA run on the dequantized blocks.
#include <omp.h>

#include "quant_internal.h"

namespace kvflow {
namespace quant {
namespace {

// The eight 6-bit scales and mins of a Q4_K block from its 12 packed bytes.
inline void q4_k_scales_and_mins(const uint8_t* packed, uint8_t scales[8], uint8_t mins[8]) {
  for (int j = 0; j < 4; ++j) {
    scales[j] = packed[j] & 63;
    mins[j] = packed[j + 4] & 63;
    scales[j + 4] = static_cast<uint8_t>((packed[j + 8] & 0x0F) | ((packed[j] >> 6) << 4));
    mins[j + 4] = static_cast<uint8_t>((packed[j + 8] >> 4) | ((packed[j + 4] >> 6) << 4));
  }
}

// ---- exact dequantization of one block ----

void dequantize_q8_0(const uint8_t* block, float* out) {
  const float d = fp16_to_float(block);
  const int8_t* quants = reinterpret_cast<const int8_t*>(block + 2);
  for (int i = 0; i < 32; ++i) out[i] = static_cast<float>(quants[i]) * d;
}

void dequantize_q4_0(const uint8_t* block, float* out) {
  const float d = fp16_to_float(block);
  for (int i = 0; i < 16; ++i) {
    out[i] = d * static_cast<float>((block[2 + i] & 0x0F) - 8);
    out[i + 16] = d * static_cast<float>((block[2 + i] >> 4) - 8);
  }
}

void dequantize_q4_k(const uint8_t* block, float* out) {
  const float d = fp16_to_float(block), dmin = fp16_to_float(block + 2);
  uint8_t scales[8], mins[8];
  q4_k_scales_and_mins(block + 4, scales, mins);
  const uint8_t* quants = block + 16;
  for (int c = 0; c < 4; ++c) {
    const float step_low = d * static_cast<float>(scales[2 * c]), offset_low = dmin * static_cast<float>(mins[2 * c]);
    const float step_high = d * static_cast<float>(scales[2 * c + 1]);
    const float offset_high = dmin * static_cast<float>(mins[2 * c + 1]);
    for (int l = 0; l < 32; ++l) {
      out[64 * c + l] = step_low * static_cast<float>(quants[32 * c + l] & 0x0F) - offset_low;
      out[64 * c + 32 + l] = step_high * static_cast<float>(quants[32 * c + l] >> 4) - offset_high;
    }
  }
}

void dequantize_q6_k(const uint8_t* block, float* out) {
  const uint8_t* low = block;
  const uint8_t* high = block + 128;
  const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
  const float d = fp16_to_float(block + 208);
  float step[16];
  for (int g = 0; g < 16; ++g) step[g] = d * static_cast<float>(scales[g]);
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = low + 64 * h;
    const uint8_t* qh = high + 32 * h;
    float* o = out + 128 * h;
    const float* s = step + 8 * h;
    for (int l = 0; l < 32; ++l) {
      const int q0 = (ql[l] & 0x0F) | ((qh[l] & 3) << 4);
      const int q1 = (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4);
      const int q2 = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
      const int q3 = (ql[l + 32] >> 4) | ((qh[l] >> 6) << 4);
      o[l] = s[l / 16] * static_cast<float>(q0 - 32);
      o[l + 32] = s[2 + l / 16] * static_cast<float>(q1 - 32);
      o[l + 64] = s[4 + l / 16] * static_cast<float>(q2 - 32);
      o[l + 96] = s[6 + l / 16] * static_cast<float>(q3 - 32);
    }
  }
}

}  // namespace

DequantizeBlock block_dequantizer(int type) {
  switch (type) {
    case kGgmlQ8_0: return dequantize_q8_0;
    case kGgmlQ4_0: return dequantize_q4_0;
    case kGgmlQ4_K: return dequantize_q4_k;
    default: return dequantize_q6_k;
  }
}

// Portable GEMV: each block dequantized to a stack buffer, then dotted with every x row.
void ggml_gemv_portable(const float* xf, int64_t M, int64_t K, int64_t xs, const uint8_t* w, int64_t N, int type,
                        const float* bias, float* y, int num_threads) {
  const int64_t elements = ggml_block_elements(type), bytes = ggml_block_bytes(type);
  const int64_t num_blocks = K / elements, row_bytes = num_blocks * bytes;
  const DequantizeBlock dequantize = block_dequantizer(type);
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    float block[kQK];
    for (int64_t m = 0; m < M; ++m) y[m * N + n] = 0.f;
    for (int64_t b = 0; b < num_blocks; ++b) {
      dequantize(w + n * row_bytes + b * bytes, block);
      for (int64_t m = 0; m < M; ++m) {
        float total = 0.f;
        for (int64_t i = 0; i < elements; ++i) total += block[i] * xf[m * xs + b * elements + i];
        y[m * N + n] += total;
      }
    }
    for (int64_t m = 0; m < M; ++m) y[m * N + n] += bias ? bias[n] : 0.f;
  }
}

}  // namespace quant

using namespace quant;

int64_t ggml_block_elements(int type) { return type == kGgmlQ4_K || type == kGgmlQ6_K ? kQK : 32; }

int64_t ggml_block_bytes(int type) {
  switch (type) {
    case kGgmlQ8_0: return 34;
    case kGgmlQ4_0: return 18;
    case kGgmlQ4_K: return 144;
    default: return 210;
  }
}

void ggml_dequantize(const uint8_t* blocks, int64_t rows, int64_t row_bytes, int type, float* out,
                     int num_threads) {
  const int64_t elements = ggml_block_elements(type), bytes = ggml_block_bytes(type);
  const int64_t num_blocks = row_bytes / bytes, columns = num_blocks * elements;
  const DequantizeBlock dequantize = block_dequantizer(type);
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, rows)));
#pragma omp parallel num_threads(threads)
  {
    int64_t begin, end;
    thread_range(rows, omp_get_thread_num(), omp_get_num_threads(), begin, end);
    for (int64_t n = begin; n < end; ++n)
      for (int64_t b = 0; b < num_blocks; ++b)
        dequantize(blocks + n * row_bytes + b * bytes, out + n * columns + b * elements);
  }
}

}  // namespace kvflow
