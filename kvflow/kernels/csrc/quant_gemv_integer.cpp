// The GEMV (quant_gemv.h) for Q4_0, Q4_K and Q6_K against x quantized per block (quant_activations.cpp): integer
// dots (maddubs: u8 x s8 pairs -> int16; madd: int16 x int16 multipliers -> int32) converted to float once per
// block: Q4_0 d_w d_x sum((q - 8) q_x); Q4_K d_w d_x sum_j sc_j dot(q_j, q_x_j) - dmin d_x sum_j m_j sum(q_x_j)
// (the scales as madd multipliers, the per-16 sums of q_x computed once per call); Q6_K d_w d_x
// sum_g sc_g (dot(q_g, q_x_g) - 32 sum(q_x_g)). On AVX-512 VNNI builds the K-quants take 64 quants per instruction
// (maddubs, then vpdpwssd: the scale multiply and the int32 add in one), the same integers summed in 16 lanes
// instead of 8.
#include "quant_gemv.h"

#ifdef KVFLOW_QUANT_SIMD
namespace kvflow {
namespace quant {
namespace {


// 16 int16 lanes of u8 x s8 pair sums (no saturation: |u| <= 63, |s| <= 127) times int16 multipliers, pairs
// summed: 8 int32 lanes.
inline __m256i dot_scaled(__m256i unsigned_bytes, const int8_t* signed_bytes, __m256i multipliers) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(signed_bytes));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(unsigned_bytes, x), multipliers);
}

// Q4_0 against x quantized per 32: d_w * d_x * sum((q_w - 8) * q_x), the -8 applied to the weight bytes, then
// the signed block's integer dot (accumulate_signed_block; the same integer as sum(q_w * q_x) - 8 * sum(q_x)).
struct Q4_0Block {
  using Acc = __m256;
  static constexpr int kElements = 32, kBytes = 18;
  static constexpr int64_t kPairRowsMinK = 0;  // one weight row per pass
  static int prefetch_bytes() { return kPrefetchBytes; }
  template <int MT>
  static void accumulate(const uint8_t* block, const QuantRows& rows, int64_t b, __m256* acc) {
    const float d = fp16_to_float(block);
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);  // elements 0-15 | 16-31
    const __m256i quants = _mm256_sub_epi8(low_nibbles(both), _mm256_set1_epi8(8));
    accumulate_signed_block<MT>(d, quants, rows, b, kElements, acc);
  }
};

// int16 multipliers selecting byte pairs (2j, 2j + 1) of each 128-bit lane: one int16 broadcast per lane.
inline __m256i int16_lane(int j) { return _mm256_set1_epi16(static_cast<int16_t>(((2 * j + 1) << 8) | (2 * j))); }

// A Q4_K block's eight 6-bit scales and mins as bytes 0-7 of two vectors (q4_k_scales_and_mins on whole words).
inline void q4_k_scales_and_mins_simd(const uint8_t* block, __m128i& scales8, __m128i& mins8) {
  uint32_t packed[3];
  std::memcpy(packed, block + 4, sizeof(packed));
  const uint32_t scales_low = packed[0] & 0x3F3F3F3Fu, mins_low = packed[1] & 0x3F3F3F3Fu;
  const uint32_t scales_high = (packed[2] & 0x0F0F0F0Fu) | ((packed[0] >> 2) & 0x30303030u);
  const uint32_t mins_high = ((packed[2] >> 4) & 0x0F0F0F0Fu) | ((packed[1] >> 2) & 0x30303030u);
  scales8 = _mm_set_epi32(0, 0, static_cast<int>(scales_high), static_cast<int>(scales_low));
  mins8 = _mm_set_epi32(0, 0, static_cast<int>(mins_high), static_cast<int>(mins_low));
}

#ifdef KVFLOW_QUANT_VNNI
// A Q4_K block's first 16 bytes (dwords [d | dmin, p0, p1, p2]) to its 6-bit scales and mins, bytes 0-7 and 8-15
// of one vector: the same bits as q4_k_scales_and_mins_simd's words, unpacked in the vector unit (scales low:
// p0 & 0x3F..; high: p2's low nibbles | p0's top bits; mins likewise from p1, p2's high nibbles, p1's top bits).
inline __m128i q4_k_head_simd(__m128i head) {
  const __m128i nibble_words = _mm_shuffle_epi32(head, _MM_SHUFFLE(3, 2, 3, 1));  // p0 p2 p1 p2
  const __m128i top_words = _mm_shuffle_epi32(head, _MM_SHUFFLE(2, 2, 1, 1));     // p0 p0 p1 p1
  const __m128i low = _mm_and_si128(_mm_srlv_epi32(nibble_words, _mm_set_epi32(4, 0, 0, 0)),
                                    _mm_set_epi32(0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F));
  const __m128i top = _mm_and_si128(_mm_srli_epi32(top_words, 2), _mm_set_epi32(0x30303030, 0, 0x30303030, 0));
  return _mm_or_si128(low, top);
}
#endif

// Bytes [b | b] (the same 32 bytes in both halves) to [b & 0x0F | b >> 4]. GFNI: one affine byte transform whose
// 8x8 bit matrix (one per 64-bit lane) keeps bits 0-3 in the low half and moves bits 4-7 down in the high half,
// the same bytes as the shift and mask of builds without it.
inline __m512i nibbles_low_high(__m512i bytes) {
#ifdef __GFNI__
  const __m512i matrices = _mm512_set_epi64(0x1020408000000000LL, 0x1020408000000000LL, 0x1020408000000000LL,
                                            0x1020408000000000LL, 0x0102040800000000LL, 0x0102040800000000LL,
                                            0x0102040800000000LL, 0x0102040800000000LL);
  return _mm512_gf2p8affine_epi64_epi8(bytes, matrices, 0);
#else
  return _mm512_and_si512(_mm512_mask_srli_epi16(bytes, 0xFFFF0000u, bytes, 4), _mm512_set1_epi8(0x0F));
#endif
}

// Q4_K against x quantized per 256: d_w * d_x * sum_j sc_j * dot(q_j, q_x_j) - dmin * d_x * sum_j m_j * sum(q_x_j)
// over the 8 sub-blocks j of 32, both sums integer (the scales as int16 multipliers, the mins against the
// per-16 sums of the quants), two float conversions per super-block.
struct Q4_KBlock {
  static constexpr int kElements = 256, kBytes = 144;
  static constexpr int64_t kPairRowsMinK = 0;  // one weight row per pass
  static int prefetch_bytes() { return k_quant_prefetch_bytes(); }
#ifdef KVFLOW_QUANT_VNNI
  // AVX-512 VNNI: chunk c's 32 bytes widened to 64 quants [sub-block 2c | 2c + 1], which are x's 64 quants at
  // 64 c in order: one x load, one maddubs and one vpdpwssd (scale [sc_2c x 16 | sc_2c+1 x 16]) per chunk and
  // x row, a third of the AVX2 path's instructions. The block's first 16 bytes (d, dmin, the packed scales and
  // mins) are decoded in one vector register (q4_k_head_simd) and each chunk's scales picked by an in-lane byte
  // shuffle: on Zen 4 the scalar unpacking, its moves into vector registers and the cross-lane vpermw were a
  // quarter of a block's time in cache (benchmarks/RESULTS.md, "Q4_K_M decode on Zen 4").
  using Acc = __m512;
  template <int MT>
  static void accumulate(const uint8_t* block, const QuantRows& rows, int64_t b, __m512* acc) {
    const __m128i head = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block));
    const __m128 d_dmin = _mm_cvtph_ps(head);  // d, dmin in lanes 0, 1
    const float d = _mm_cvtss_f32(d_dmin);
    const __m128i scales_mins = q4_k_head_simd(head);
    // dmin * m_j in lanes 0-7: the min term is sum_j (dmin m_j) (d_x sum(q_x_j)), one multiply-add per x row.
    const __m512 dmin_mins = _mm512_zextps256_ps512(
        _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(d_dmin)),
                      _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(scales_mins, scales_mins)))));
    const __m512i scale_bytes = _mm512_broadcast_i32x4(scales_mins);  // s0..s7 at bytes 0-7 of each lane
    __m512i sums[MT];
    for (int m = 0; m < MT; ++m) sums[m] = _mm512_setzero_si512();
    const int8_t* x = rows.quants + b * kElements;
    for (int c = 0; c < 4; ++c) {
      const __m512i bytes =
          _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16 + 32 * c)));
      const __m512i quants = nibbles_low_high(bytes);
      // int16 lanes 0-15 sc_2c, 16-31 sc_2c+1: byte 2c (2c + 1) then a zero byte (shuffle index 0x80).
      const __m512i pick = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16(static_cast<int16_t>(0x8000 | 2 * c)),
                                                   _mm512_set1_epi16(static_cast<int16_t>(0x8000 | (2 * c + 1))));
      const __m512i scale = _mm512_shuffle_epi8(scale_bytes, pick);
      for (int m = 0; m < MT; ++m) {
        const __m512i xm = _mm512_loadu_si512(x + m * rows.quant_stride + 64 * c);
        sums[m] = _mm512_dpwssd_epi32(sums[m], _mm512_maddubs_epi16(quants, xm), scale);
      }
    }
    for (int m = 0; m < MT; ++m) {
      const float dx = rows.scales[m * rows.scale_stride + b];
      const __m512 x_sums = _mm512_zextps256_ps512(
          _mm256_loadu_ps(rows.scaled_sums + m * (rows.sum_stride / 2) + b * (kElements / 32)));
      acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(d * dx), _mm512_cvtepi32_ps(sums[m]), acc[m]);
      acc[m] = _mm512_fnmadd_ps(dmin_mins, x_sums, acc[m]);
    }
  }
#else
  using Acc = __m256;
  template <int MT>
  static void accumulate(const uint8_t* block, const QuantRows& rows, int64_t b, __m256* acc) {
    const float d = fp16_to_float(block), dmin = fp16_to_float(block + 2);
    __m128i scales8, mins8;
    q4_k_scales_and_mins_simd(block, scales8, mins8);
    const __m256i scales16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(scales8));  // s0..s7 in each lane
    const __m256i mins_per16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mins8, mins8));  // m0 m0 m1 m1 .. m7 m7
    __m256i sums[MT];
    for (int m = 0; m < MT; ++m) sums[m] = _mm256_setzero_si256();
    const int8_t* x = rows.quants + b * kElements;
    for (int c = 0; c < 4; ++c) {  // 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high ones
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16 + 32 * c));
      const __m256i low = low_nibbles(bytes), high = high_nibbles(bytes);
      const __m256i scale_low = _mm256_shuffle_epi8(scales16, int16_lane(2 * c));
      const __m256i scale_high = _mm256_shuffle_epi8(scales16, int16_lane(2 * c + 1));
      for (int m = 0; m < MT; ++m) {
        const int8_t* xm = x + m * rows.quant_stride + 64 * c;
        sums[m] = _mm256_add_epi32(sums[m], _mm256_add_epi32(dot_scaled(low, xm, scale_low),
                                                             dot_scaled(high, xm + 32, scale_high)));
      }
    }
    for (int m = 0; m < MT; ++m) {
      const float dx = rows.scales[m * rows.scale_stride + b];
      const __m256i x_sums = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(rows.sums + m * rows.sum_stride + b * (kElements / 16)));
      const __m256i min_terms = _mm256_madd_epi16(mins_per16, x_sums);  // m_j * sum(q_x_j), lane j
      acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(sums[m]), acc[m]);
      acc[m] = _mm256_fnmadd_ps(_mm256_set1_ps(dmin * dx), _mm256_cvtepi32_ps(min_terms), acc[m]);
    }
  }
#endif
};

#ifdef KVFLOW_QUANT_VNNI
// Q6_K's bits 4-5 for 64 quants from [qh | qh] (the same 32 bytes in both halves): the first 64 of a half take qh's
// bit pairs 0 (low half) and 1 (high half), the second 64 pairs 2 and 3; GFNI moves each pair to bits 4-5 in one
// affine byte transform (an 8x8 bit matrix per 64-bit lane), other builds shift each 16-bit lane and mask.
struct Q6KHighBits {
  int64_t low_matrix, high_matrix;  // GFNI: the bit pair to bits 4-5
  int low_count, high_count;        // else: each 16-bit lane shifted by these, left for the first 64, right after
};
constexpr Q6KHighBits kQ6KFirstHighBits{0x01020000LL, 0x04080000LL, 4, 2};
constexpr Q6KHighBits kQ6KSecondHighBits{0x10200000LL, 0x40800000LL, 0, 2};

// (low & nibble) | the high bits `bits` picks from `high`: 64 6-bit quants.
template <bool kFirst>
inline __m512i q6_k_quants(__m512i low, __m512i nibble, __m512i high, const Q6KHighBits& bits) {
#ifdef __GFNI__
  const __m512i matrices = _mm512_mask_blend_epi64(0xF0, _mm512_set1_epi64(bits.low_matrix),
                                                   _mm512_set1_epi64(bits.high_matrix));
  const __m512i top = _mm512_gf2p8affine_epi64_epi8(high, matrices, 0);
#else
  const __m512i counts = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16(static_cast<int16_t>(bits.low_count)),
                                                 _mm512_set1_epi16(static_cast<int16_t>(bits.high_count)));
  const __m512i shifted = kFirst ? _mm512_sllv_epi16(high, counts) : _mm512_srlv_epi16(high, counts);
  const __m512i top = _mm512_and_si512(shifted, _mm512_set1_epi8(0x30));
#endif
  return _mm512_ternarylogic_epi32(low, nibble, top, 0xEA);  // (low & nibble) | top
}
#endif

// Q6_K against x quantized per 256: d_w * d_x * sum_g sc_g * (dot(q_g, q_x_g) - 32 * sum(q_x_g)) over the 16
// groups g of 16, all integer (the int8 scales as int16 multipliers; the -32 offset against the per-16 sums of
// the quants), one float conversion per super-block.
struct Q6_KBlock {
  static constexpr int kElements = 256, kBytes = 210;
  static constexpr int64_t kPairRowsMinK = 0;  // one weight row per pass
  static int prefetch_bytes() { return k_quant_prefetch_bytes(); }
#ifdef KVFLOW_QUANT_VNNI
  // AVX-512 VNNI: 64 quants at a time, elements 128 h + [0, 64) (low nibbles of ql[64 h, 64 h + 64) with qh's
  // bit pairs 0 and 1) and 128 h + [64, 128) (high nibbles with bit pairs 2 and 3), x's 64 quants there in order:
  // one x load, one maddubs and one vpdpwssd (scales of groups g..g+3, 8 int16 lanes each) per 64 and x row.
  using Acc = __m512;
  template <int MT>
  static void accumulate(const uint8_t* block, const QuantRows& rows, int64_t b, __m512* acc) {
    const float d = fp16_to_float(block + 208);
    const __m128i scales8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));
    const __m512i scales16 = _mm512_cvtepi8_epi16(_mm256_zextsi128_si256(scales8));  // sc_0..sc_15, lanes 0-15
    // The -32 offset first: -32 sc_g times sum(q_x_g), lanes 0-7 (|32 sc_g| <= 4096 fits int16).
    const __m512i offset_scales = _mm512_sub_epi16(_mm512_setzero_si512(), _mm512_slli_epi16(scales16, 5));
    __m512i sums[MT];
    for (int m = 0; m < MT; ++m) {
      const __m512i x_sums = _mm512_zextsi256_si512(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(rows.sums + m * rows.sum_stride + b * (kElements / 16))));
      sums[m] = _mm512_dpwssd_epi32(_mm512_setzero_si512(), x_sums, offset_scales);
    }
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const int8_t* x = rows.quants + b * kElements;
    for (int h = 0; h < 2; ++h) {
      const __m512i low = _mm512_loadu_si512(block + 64 * h);
      const __m512i high =
          _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * h)));
      const __m512i first = q6_k_quants<true>(low, nibble, high, kQ6KFirstHighBits);
      const __m512i second = q6_k_quants<false>(_mm512_srli_epi16(low, 4), nibble, high, kQ6KSecondHighBits);
      const __m512i group = _mm512_set1_epi16(static_cast<int16_t>(8 * h));
      const __m512i lane_group = _mm512_srli_epi16(
          _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9,
                           8, 7, 6, 5, 4, 3, 2, 1, 0),
          3);  // 16-bit lane i covers quants 2i, 2i + 1: group i / 8 of the 64
      const __m512i scale_first = _mm512_permutexvar_epi16(_mm512_add_epi16(group, lane_group), scales16);
      const __m512i scale_second = _mm512_permutexvar_epi16(
          _mm512_add_epi16(_mm512_add_epi16(group, _mm512_set1_epi16(4)), lane_group), scales16);
      for (int m = 0; m < MT; ++m) {
        const int8_t* xm = x + m * rows.quant_stride + 128 * h;
        sums[m] = _mm512_dpwssd_epi32(sums[m], _mm512_maddubs_epi16(first, _mm512_loadu_si512(xm)), scale_first);
        sums[m] =
            _mm512_dpwssd_epi32(sums[m], _mm512_maddubs_epi16(second, _mm512_loadu_si512(xm + 64)), scale_second);
      }
    }
    for (int m = 0; m < MT; ++m) {
      const __m512 scale = _mm512_set1_ps(d * rows.scales[m * rows.scale_stride + b]);
      acc[m] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sums[m]), acc[m]);
    }
  }
#else
  using Acc = __m256;
  template <int MT>
  static void accumulate(const uint8_t* block, const QuantRows& rows, int64_t b, __m256* acc) {
    const float d = fp16_to_float(block + 208);
    const __m128i scales8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));
    __m256i sums[MT];
    for (int m = 0; m < MT; ++m) sums[m] = _mm256_setzero_si256();
    const __m256i mask = _mm256_set1_epi8(0x30);
    const int8_t* x = rows.quants + b * kElements;
    for (int h = 0; h < 2; ++h) {
      const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * h));
      const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * h + 32));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * h));
      const __m256i quants[4] = {
          _mm256_or_si256(low_nibbles(ql0), _mm256_and_si256(_mm256_slli_epi16(qh, 4), mask)),
          _mm256_or_si256(low_nibbles(ql1), _mm256_and_si256(_mm256_slli_epi16(qh, 2), mask)),
          _mm256_or_si256(high_nibbles(ql0), _mm256_and_si256(qh, mask)),
          _mm256_or_si256(high_nibbles(ql1), _mm256_and_si256(_mm256_srli_epi16(qh, 2), mask))};
      for (int p = 0; p < 4; ++p) {  // quants[p]: elements 128 h + 32 p + [0, 32), groups g = 8 h + 2 p, g + 1
        const int g = 8 * h + 2 * p;
        const __m128i pick = _mm_set_epi64x(0x0101010101010101LL * (g + 1), 0x0101010101010101LL * g);
        const __m256i scale = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales8, pick));  // sc_g x 8 | sc_g+1 x 8
        for (int m = 0; m < MT; ++m)
          sums[m] = _mm256_add_epi32(sums[m],
                                     dot_scaled(quants[p], x + m * rows.quant_stride + 128 * h + 32 * p, scale));
      }
    }
    const __m256i scales16 = _mm256_cvtepi8_epi16(scales8);
    for (int m = 0; m < MT; ++m) {
      const __m256i x_sums = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(rows.sums + m * rows.sum_stride + b * (kElements / 16)));
      const __m256i offsets = _mm256_slli_epi32(_mm256_madd_epi16(scales16, x_sums), 5);  // 32 sc_g sum(q_x_g)
      const __m256 scale = _mm256_set1_ps(d * rows.scales[m * rows.scale_stride + b]);
      acc[m] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(_mm256_sub_epi32(sums[m], offsets)), acc[m]);
    }
  }
#endif
};

}  // namespace

void integer_gemv(int type, const QuantRows& x, int64_t M, int64_t K, const uint8_t* w, int64_t N, const float* bias,
                  float* y, int num_threads) {
  switch (type) {
    case kGgmlQ4_0: ggml_gemv<Q4_0Block>(x, M, K, w, N, bias, y, num_threads); break;
    case kGgmlQ4_K: ggml_gemv<Q4_KBlock>(x, M, K, w, N, bias, y, num_threads); break;
    default: ggml_gemv<Q6_KBlock>(x, M, K, w, N, bias, y, num_threads); break;
  }
}

}  // namespace quant
}  // namespace kvflow
#endif  // KVFLOW_QUANT_SIMD
