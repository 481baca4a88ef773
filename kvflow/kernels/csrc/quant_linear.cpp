// The quantized-weight products kernels.h declares (llama.cpp's GGUF blocks Q8_0, Q4_0, Q4_K, Q6_K, and weight-only
// int8 per channel), each choosing its kernel by the number of activation rows M:
//
// * Q4_0 / Q4_K / Q6_K (x quantized per block, quant_activations.cpp): up to gemv_max_rows the integer product,
//   the GEMV on the blocks (quant_gemv_integer.cpp; blocked over weight tiles and 64-row x blocks above 8 rows) or,
//   above kInterleavedAboveRows on AVX-512 VNNI builds, the same integers on 16-row weight tiles repacked in cache
//   so that lanes are weight rows (quant_repack.cpp); above gemv_max_rows the tiled product on the
//   fake-quantized x (quant_tiled.cpp). Builds without AVX2 + FMA run the portable GEMV (quant_reference.cpp) on
//   that x up to gemv_max_rows.
// * Q8_0: x quantized per 32 (the default) as the 4-bit types' is, up to gemv_max_rows the integer GEMV on the
//   blocks (quant_gemv_8bit.cpp; blocked above 8 rows, no interleaved tiles), above it the tiled product on the
//   fake-quantized x; under KVFLOW_Q8_0_ACTIVATIONS=float32 fp32 x: up to gemv_max_rows the float GEMV
//   (quant_gemv_8bit.cpp), above it the tiled product. ggml_linear_w8a8 is its W8A8 form for prefill-sized M
//   (quant_w8a8.cpp, AVX-512 VNNI builds).
// * int8 (fp32 x): up to gemv_max_rows the GEMV; above it W8A8 on AMX tiles where usable, else on VNNI, else (no
//   VNNI) the tiled product.
//
// Every path sums each output element on one thread in a fixed order: results do not depend on the thread count.
#include <stdexcept>

#include "cpu_features.h"
#include "quant_internal.h"

namespace kvflow {

using namespace quant;

template <typename T>
void ggml_linear(const T* x, int64_t M, int64_t K, int64_t x_stride, const uint8_t* w, int64_t N, int type,
                 const float* bias, float* y, int64_t gemv_max_rows, int num_threads) {
  const int64_t xs = padded8(K), block = ggml_activation_block(type);
  std::vector<float> xf = widen_rows<T>(x, M, K, x_stride, xs);
#ifdef KVFLOW_QUANT_SIMD
  if (M <= gemv_max_rows && block) {
    const QuantizedActivations quantized(xf.data(), M, K, xs, block);
    const QuantRows rows{quantized.quants.data(), quantized.scales.data(), quantized.sums.data(),
                         quantized.scaled_sums.empty() ? nullptr : quantized.scaled_sums.data(), K, K / block, K / 16};
    if (type == kGgmlQ8_0) {  // no interleaved tiles: the blocked GEMV at every M it takes
      q8_0_integer_gemv(rows, M, K, w, N, bias, y, num_threads);
      return;
    }
#ifdef KVFLOW_QUANT_VNNI
    if (M > kInterleavedAboveRows) {
      interleaved_product(type, rows, M, K, w, N, bias, y, num_threads);
      return;
    }
#endif
    integer_gemv(type, rows, M, K, w, N, bias, y, num_threads);
    return;
  }
#endif
  // The fp32 products see the values the integer GEMV computes with: every M gives the same numbers.
  if (block) fake_quantize_rows(xf.data(), M, K, xs, block);
  if (M > gemv_max_rows) {
    ggml_tiled_product(xf.data(), M, K, xs, w, N, type, bias, y, num_threads);
    return;
  }
#ifdef KVFLOW_QUANT_SIMD
  q8_0_gemv(FloatRows{xf.data(), xs}, M, K, w, N, bias, y, num_threads);
#else
  ggml_gemv_portable(xf.data(), M, K, xs, w, N, type, bias, y, num_threads);
#endif
}

template <typename T>
void int8_linear_amx(const T* x, int64_t M, int64_t K, int64_t x_stride, const int8_t* w, const float* scale,
                     int64_t N, const float* bias, float* y, bool emulated, int num_threads) {
  const int64_t xs = padded8(K);
  const std::vector<float> xf = widen_rows<T>(x, M, K, x_stride, xs);
  int8_gemm_amx(xf.data(), M, K, xs, w, scale, N, bias, y, emulated, num_threads);
}

template <typename T>
void int8_linear(const T* x, int64_t M, int64_t K, int64_t x_stride, const int8_t* w, const float* scale, int64_t N,
                 const float* bias, float* y, int64_t gemv_max_rows, int num_threads) {
  const int64_t xs = padded8(K);
  const std::vector<float> xf = widen_rows<T>(x, M, K, x_stride, xs);
#ifdef KVFLOW_QUANT_SIMD
  if (M <= gemv_max_rows) {
    int8_gemv(xf.data(), M, K, xs, w, scale, N, bias, y, num_threads);
    return;
  }
#endif
#ifdef KVFLOW_QUANT_VNNI
  if (amx_usable()) {
    int8_gemm_amx(xf.data(), M, K, xs, w, scale, N, bias, y, false, num_threads);
    return;
  }
  int8_gemm_vnni(xf.data(), M, K, xs, w, scale, N, bias, y, num_threads);
#else
  int8_tiled_product(xf.data(), M, K, xs, w, scale, N, bias, y, num_threads);
#endif
}

template <typename T>
void ggml_linear_w8a8(const T* x, int64_t M, int64_t K, int64_t x_stride, const uint8_t* w, int64_t N, int type,
                      const float* bias, float* y, int num_threads) {
#ifdef KVFLOW_QUANT_VNNI
  const int64_t xs = padded8(K);
  const std::vector<float> xf = widen_rows<T>(x, M, K, x_stride, xs);
  (void)type;  // Q8_0 (the binding checks)
  q8_0_gemm_w8a8(xf.data(), M, K, xs, w, N, bias, y, num_threads);
#else
  (void)x, (void)M, (void)K, (void)x_stride, (void)w, (void)N, (void)type, (void)bias, (void)y, (void)num_threads;
  throw std::runtime_error("ggml_linear_w8a8 needs an AVX-512 VNNI build");
#endif
}

int64_t k_quant_interleaved_above_rows() {
#ifdef KVFLOW_QUANT_VNNI
  return kInterleavedAboveRows;
#else
  return -1;
#endif
}

bool has_w8a8_kernels() {
#ifdef KVFLOW_QUANT_VNNI
  return true;
#else
  return false;
#endif
}

template void ggml_linear_w8a8<float>(const float*, int64_t, int64_t, int64_t, const uint8_t*, int64_t, int,
                                      const float*, float*, int);
template void ggml_linear_w8a8<bf16>(const bf16*, int64_t, int64_t, int64_t, const uint8_t*, int64_t, int,
                                     const float*, float*, int);
template void ggml_linear<float>(const float*, int64_t, int64_t, int64_t, const uint8_t*, int64_t, int, const float*,
                                 float*, int64_t, int);
template void ggml_linear<bf16>(const bf16*, int64_t, int64_t, int64_t, const uint8_t*, int64_t, int, const float*,
                                float*, int64_t, int);
template void int8_linear_amx<float>(const float*, int64_t, int64_t, int64_t, const int8_t*, const float*, int64_t,
                                     const float*, float*, bool, int);
template void int8_linear_amx<bf16>(const bf16*, int64_t, int64_t, int64_t, const int8_t*, const float*, int64_t,
                                    const float*, float*, bool, int);
template void int8_linear<float>(const float*, int64_t, int64_t, int64_t, const int8_t*, const float*, int64_t,
                                 const float*, float*, int64_t, int);
template void int8_linear<bf16>(const bf16*, int64_t, int64_t, int64_t, const int8_t*, const float*, int64_t,
                                const float*, float*, int64_t, int);

}  // namespace kvflow
