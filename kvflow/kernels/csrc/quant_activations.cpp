// Activation quantization: Q4_0, Q4_K and Q6_K products quantize x as llama.cpp does (per 32 / 256 / 256 columns:
// d = amax / 127, q = round-half-even(x / d)), and so does Q8_0 (per 32) unless KVFLOW_Q8_0_ACTIVATIONS=float32;
// int8 keeps fp32 x. The integer GEMV and the interleaved tiles multiply the int8 quants; the tiled product (and
// quant.py's dequantize + torch path) runs on q * d (fake_quantize_rows), so every M computes the same sum.
#include <cctype>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "quant_internal.h"

namespace kvflow {
namespace quant {

// x[0:count] as int8 quants; returns the scale d = amax / 127 (q = round-half-even(x / d), 0 when d = 0): the
// same float32 operations as quant.py's quantize_activations_reference, so the quants are identical.
float quantize_block(const float* x, int64_t count, int8_t* quants) {
  float amax = 0.f;
  int64_t i = 0;
#ifdef KVFLOW_AVX512
  // 16 lanes at a time, the same float32 operations per element (the maximum is exact in any order and skips
  // NaN as std::max does; the division is correctly rounded either way; roundscale rounds to nearest-even as
  // nearbyint does): the quants and d equal the scalar loop's bit for bit, at a fraction of its time (it runs
  // on one thread before every decode product).
  __m512 lanes_max = _mm512_setzero_ps();
  for (; i + 16 <= count; i += 16) lanes_max = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i)), lanes_max);
  amax = _mm512_reduce_max_ps(lanes_max);
#endif
  for (; i < count; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.f;
  i = 0;
#ifdef KVFLOW_AVX512
  if (d > 0.f) {
    const __m512 divisor = _mm512_set1_ps(d), high = _mm512_set1_ps(127.f), low = _mm512_set1_ps(-127.f);
    for (; i + 16 <= count; i += 16) {
      const __m512 rounded = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), divisor),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      // Operand order as std::max / std::min's: a NaN quotient clamps to -127, as the scalar loop's does.
      const __m512 clamped = _mm512_min_ps(_mm512_max_ps(rounded, low), high);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(quants + i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(clamped)));
    }
  }
#endif
  for (; i < count; ++i)
    quants[i] = d > 0.f ? static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x[i] / d)))) : 0;
  return d;
}

QuantizedActivations::QuantizedActivations(const float* xf, int64_t M, int64_t K_, int64_t xs, int64_t block_)
    : K(K_), block(block_), quants(static_cast<size_t>(M * K_)), scales(static_cast<size_t>(M * K_ / block_)),
      sums(static_cast<size_t>(M * K_ / 16)), scaled_sums(block_ == kQK ? static_cast<size_t>(M * K_ / 32) : 0) {
  for (int64_t m = 0; m < M; ++m) {
    int8_t* q = quants.data() + m * K;
    for (int64_t b = 0; b < K / block; ++b)
      scales[m * (K / block) + b] = quantize_block(xf + m * xs + b * block, block, q + b * block);
    for (int64_t j = 0; j < K / 16; ++j) {
      int total = 0;
      for (int i = 0; i < 16; ++i) total += q[16 * j + i];
      sums[m * (K / 16) + j] = static_cast<int16_t>(total);
    }
    if (block != kQK) continue;
    for (int64_t j = 0; j < K / 32; ++j) {
      const int16_t* pair = sums.data() + m * (K / 16) + 2 * j;
      scaled_sums[m * (K / 32) + j] = scales[m * (K / kQK) + j / 8] * static_cast<float>(pair[0] + pair[1]);
    }
  }
}

// Replaces x's rows (fp32, `xs` floats apart) by their quantized values q * d: what the integer GEMV computes
// with, for the products that run in fp32.
void fake_quantize_rows(float* xf, int64_t M, int64_t K, int64_t xs, int64_t block) {
  std::vector<int8_t> quants(static_cast<size_t>(block));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < K / block; ++b) {
      float* x = xf + m * xs + b * block;
      const float d = quantize_block(x, block, quants.data());
      for (int64_t i = 0; i < block; ++i) x[i] = static_cast<float>(quants[i]) * d;
    }
}

}  // namespace quant

using namespace quant;

bool q8_0_int8_activations() {
  const char* value = std::getenv(kQ8_0ActivationsEnv);
  std::string choice = value ? value : "";
  const auto blank = [](unsigned char c) { return std::isspace(c) != 0; };
  choice.erase(choice.begin(), std::find_if_not(choice.begin(), choice.end(), blank));
  choice.erase(std::find_if_not(choice.rbegin(), choice.rend(), blank).base(), choice.end());
  for (char& c : choice) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (choice.empty() || choice == "int8") return true;
  if (choice == "float32") return false;
  throw std::invalid_argument(std::string(kQ8_0ActivationsEnv) + "='" + (value ? value : "") +
                              "' is not one of float32, int8");
}

// Elements per activation scale for `type`: its weight block (32 for Q4_0 and Q8_0, 256 for the K-quants); 0 for
// Q8_0 under KVFLOW_Q8_0_ACTIVATIONS=float32, whose products then keep fp32 activations.
int64_t ggml_activation_block(int type) {
  switch (type) {
    case kGgmlQ8_0: return q8_0_int8_activations() ? 32 : 0;
    case kGgmlQ4_0: return 32;
    case kGgmlQ4_K:
    case kGgmlQ6_K: return kQK;
    default: return 0;
  }
}

template <typename T>
void ggml_quantize_activations(const T* x, int64_t M, int64_t K, int64_t x_stride, int type, int8_t* quants,
                               float* scales) {
  const int64_t xs = padded8(K), block = ggml_activation_block(type);
  const std::vector<float> xf = widen_rows<T>(x, M, K, x_stride, xs);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < K / block; ++b)
      scales[m * (K / block) + b] = quantize_block(xf.data() + m * xs + b * block, block, quants + m * K + b * block);
}

template void ggml_quantize_activations<float>(const float*, int64_t, int64_t, int64_t, int, int8_t*, float*);
template void ggml_quantize_activations<bf16>(const bf16*, int64_t, int64_t, int64_t, int, int8_t*, float*);

}  // namespace kvflow
