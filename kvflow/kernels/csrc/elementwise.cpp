// The per-layer elementwise ops of a decode step, each one pass over its rows instead of several tensor ops.
// Every intermediate that PyTorch's expression rounds to T is rounded here too (round16 / round_to), so results
// equal the PyTorch reference except where a reduction order (RMSNorm's mean) or exp's last ulp differs.
#include <omp.h>

#include <algorithm>

#include "common.h"
#include "kernels.h"

namespace kvflow {
namespace {
// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelElements = 1 << 16;
}  // namespace

template <typename T>
void add_rms_norm(const T* x, const T* residual, const T* weight, int64_t rows, int64_t hidden, float eps, T* out,
                  T* residual_out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * hidden >= kParallelElements)
  for (int64_t row = 0; row < rows; ++row) {
    const T* xr = x + row * hidden;
    const T* rr = residual ? residual + row * hidden : nullptr;
    T* sum_row = residual ? residual_out + row * hidden : nullptr;
    const T* summed = residual ? sum_row : xr;
    T* o = out + row * hidden;
    float sum_squares = 0.f;
#ifdef KVFLOW_AVX512
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < hidden; i += 16) {
      __mmask16 mask = tail_mask(hidden - i);
      __m512 value = load16(xr + i, mask);
      if (rr) {
        value = round16<T>(_mm512_add_ps(value, load16(rr + i, mask)));
        store16(sum_row + i, value, mask);
      }
      acc = _mm512_fmadd_ps(value, value, acc);
    }
    sum_squares = _mm512_reduce_add_ps(acc);
#else
#pragma omp simd reduction(+ : sum_squares)
    for (int64_t i = 0; i < hidden; ++i) {
      float value = to_float<T>(xr[i]);
      if (rr) {
        value = round_to<T>(value + to_float<T>(rr[i]));
        sum_row[i] = from_float<T>(value);
      }
      sum_squares += value * value;
    }
#endif
    const float inv_rms = 1.f / std::sqrt(sum_squares / static_cast<float>(hidden) + eps);
#ifdef KVFLOW_AVX512
    const __m512 scale = _mm512_set1_ps(inv_rms);
    for (int64_t i = 0; i < hidden; i += 16) {
      __mmask16 mask = tail_mask(hidden - i);
      __m512 normed = round16<T>(_mm512_mul_ps(load16(summed + i, mask), scale));
      store16(o + i, _mm512_mul_ps(load16(weight + i, mask), normed), mask);
    }
#else
    for (int64_t i = 0; i < hidden; ++i) {
      float normed = round_to<T>(to_float<T>(summed[i]) * inv_rms);
      o[i] = from_float<T>(to_float<T>(weight[i]) * normed);
    }
#endif
  }
}

template <typename T>
void silu_and_mul(const T* gate_up, int64_t rows, int64_t d, int64_t in_stride, T* out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * d >= kParallelElements)
  for (int64_t row = 0; row < rows; ++row) {
    const T* gate = gate_up + row * in_stride;
    const T* up = gate + d;
    T* o = out + row * d;
#ifdef KVFLOW_AVX512
    const __m512 one = _mm512_set1_ps(1.f);
    for (int64_t i = 0; i < d; i += 16) {
      __mmask16 mask = tail_mask(d - i);
      __m512 g = load16(gate + i, mask);
      __m512 denominator = _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
      __m512 activated = round16<T>(_mm512_div_ps(g, denominator));
      store16(o + i, _mm512_mul_ps(activated, load16(up + i, mask)), mask);
    }
#else
    for (int64_t i = 0; i < d; ++i) {
      float g = to_float<T>(gate[i]);
      float activated = round_to<T>(g / (1.f + std::exp(-g)));
      o[i] = from_float<T>(activated * to_float<T>(up[i]));
    }
#endif
  }
}

template <typename T>
void rotary(const T* heads, int64_t tokens, int64_t num_heads, int64_t head_dim, int64_t token_stride,
            int64_t head_stride, const T* cos, const T* sin, T* out, int num_threads) {
  const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) if (tokens * num_heads * head_dim >= kParallelElements)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* c = cos + t * half;
    const T* s = sin + t * half;
    for (int64_t h = 0; h < num_heads; ++h) {
      const T* first = heads + t * token_stride + h * head_stride;
      const T* second = first + half;
      T* o = out + (t * num_heads + h) * head_dim;
#ifdef KVFLOW_AVX512
      for (int64_t i = 0; i < half; i += 16) {
        __mmask16 mask = tail_mask(half - i);
        __m512 x1 = load16(first + i, mask), x2 = load16(second + i, mask);
        __m512 cv = load16(c + i, mask), sv = load16(s + i, mask);
        __m512 rotated1 = _mm512_sub_ps(round16<T>(_mm512_mul_ps(x1, cv)), round16<T>(_mm512_mul_ps(x2, sv)));
        __m512 rotated2 = _mm512_add_ps(round16<T>(_mm512_mul_ps(x2, cv)), round16<T>(_mm512_mul_ps(x1, sv)));
        store16(o + i, rotated1, mask);
        store16(o + half + i, rotated2, mask);
      }
#else
      for (int64_t i = 0; i < half; ++i) {
        float x1 = to_float<T>(first[i]), x2 = to_float<T>(second[i]);
        float cv = to_float<T>(c[i]), sv = to_float<T>(s[i]);
        o[i] = from_float<T>(round_to<T>(x1 * cv) - round_to<T>(x2 * sv));
        o[half + i] = from_float<T>(round_to<T>(x2 * cv) + round_to<T>(x1 * sv));
      }
#endif
    }
  }
}

template void add_rms_norm<float>(const float*, const float*, const float*, int64_t, int64_t, float, float*, float*,
                                  int);
template void add_rms_norm<bf16>(const bf16*, const bf16*, const bf16*, int64_t, int64_t, float, bf16*, bf16*, int);
template void silu_and_mul<float>(const float*, int64_t, int64_t, int64_t, float*, int);
template void silu_and_mul<bf16>(const bf16*, int64_t, int64_t, int64_t, bf16*, int);
template void rotary<float>(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, const float*, const float*,
                            float*, int);
template void rotary<bf16>(const bf16*, int64_t, int64_t, int64_t, int64_t, int64_t, const bf16*, const bf16*, bf16*,
                           int);

}  // namespace kvflow
