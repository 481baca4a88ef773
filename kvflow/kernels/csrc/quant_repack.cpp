// Q4_0, Q4_K and Q6_K on interleaved 16-row weight tiles, for more x rows than kInterleavedAboveRows (AVX-512 VNNI
// builds; the GEMV, quant_gemv_integer.cpp, takes the fewer rows).
//
// The GEMV's lanes run along k: every 64 quants cost a maddubs and a vpdpwssd (the sub-block scales as int16
// multipliers) per x row. Here each thread repacks 16 weight rows at a time (per call, into a buffer of 5 KiB per
// K-quant block, 576 bytes per Q4_0 one, that stays in L2; the weights in memory stay GGUF blocks) so that lanes
// are rows: for each group of 4 columns one vector holds those 4 quants (u8: Q4_0 / Q4_K 0-15, Q6_K 0-63) of all
// 16 rows, and one vpdpbusd against x's 4 quants broadcast adds 64 products. The scales then apply once per
// sub-block (32 columns for Q4_0 and Q4_K, 16 for Q6_K) as a float multiply-add with d * sc per lane, d_x once per
// block; Q4_K's min term is one multiply-add per sub-block, Q6_K's -32 offset (Q4_0's -8) starts each sub-block's
// int32 dot at -32 sum(q_x) (-8 sum(q_x)). The repacking (a 16 x 8 or 16 x 4 dword transpose per 32 or 16 bytes of
// quants) costs about what 10 x rows do and is done once per tile and call, which is why the GEMV keeps the
// fewest rows; every x row then runs against the tile in passes of kLaneMT. Each output is summed by one thread in
// a fixed order, each x row alone: a row's output depends neither on the thread count nor on the rows beside it
// (above the threshold; the GEMV below it adds the same integers in another order).
#include <omp.h>

#include "quant_internal.h"

#ifdef KVFLOW_QUANT_VNNI
namespace kvflow {
namespace quant {
namespace {

constexpr int kLaneRows = 16;  // weight rows per interleaved tile: one per int32 lane
constexpr int kLaneMT = 8;     // x rows per pass: 8 int32 dots, 8 block sums and 8 accumulators in registers

// out[g] lane r = dword g of rows[r] (16 rows of 8 dwords).
inline void transpose_16x8_dwords(const __m256i rows[16], __m512i out[8]) {
  __m512i z[8], t[8], u[8];
  // z[p]: row p in its low half, row p + 8 in its high half; then an 8 x 8 transpose within each half.
  for (int p = 0; p < 8; ++p) z[p] = _mm512_inserti64x4(_mm512_castsi256_si512(rows[p]), rows[p + 8], 1);
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // u[4 h + g], 128-bit lanes: rows 4h..4h+3 at dword g | at g + 4 | rows + 8 ...
    u[4 * h + 0] = _mm512_unpacklo_epi64(t[4 * h + 0], t[4 * h + 2]);
    u[4 * h + 1] = _mm512_unpackhi_epi64(t[4 * h + 0], t[4 * h + 2]);
    u[4 * h + 2] = _mm512_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
    u[4 * h + 3] = _mm512_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
  }
  const __m512i low = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0), high = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
  for (int g = 0; g < 4; ++g) {
    out[g] = _mm512_permutex2var_epi64(u[g], low, u[g + 4]);
    out[g + 4] = _mm512_permutex2var_epi64(u[g], high, u[g + 4]);
  }
}

// x's 4 quants at `quants` broadcast to every lane.
inline __m512i broadcast4(const int8_t* quants) {
  int32_t word;
  std::memcpy(&word, quants, 4);
  return _mm512_set1_epi32(word);
}

// One block of a tile's weight rows: row r's block at `first` + r * row_bytes for r < count; the lanes past
// `count` (a partial last tile) read as zeros.
struct TileRows {
  const uint8_t* first;
  int64_t row_bytes;
  int count;

  const uint8_t* row(int r) const { return r < count ? first + r * row_bytes : nullptr; }
  // Lane r: the 4 bytes at `offset` of row r's block.
  __m512i gather(int64_t offset) const {
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i offsets = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(static_cast<int32_t>(row_bytes)));
    return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), tail_mask(count), offsets, first + offset, 1);
  }
  // Row r's 32 bytes at `offset`.
  __m256i load32(int r, int64_t offset) const {
    return r < count ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row(r) + offset)) : _mm256_setzero_si256();
  }
};

// The fp16 values in the low (high = false) or high 16 bits of each lane, as fp32 (exact).
inline __m512 fp16_lanes(__m512i words, bool high) {
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(high ? _mm512_srli_epi32(words, 16) : words));
}

// Each lane's dword shifted right by `shift`, then masked.
inline __m512i lane_bits(__m512i words, int shift, int mask) {
  return _mm512_and_si512(_mm512_srli_epi32(words, static_cast<unsigned>(shift)), _mm512_set1_epi32(mask));
}

struct Q4_KTile {
  static constexpr int kElements = 256, kBytes = 144;
  __m512i quants[8][8];  // [sub-block j][group g]: lane r = quants 32 j + 4 g .. 32 j + 4 g + 3 of row r
  __m512 scales[8];      // lane r: d * sc_j of row r
  __m512 mins[8];        // lane r: dmin * m_j of row r

  void repack(const TileRows& rows) {
    // The 16 bytes before the quants, lanes = rows: d and dmin, then the 12 packed 6-bit scales and mins
    // (q4_k_scales_and_mins: j < 4 from bytes j and j + 4, j >= 4 from byte j + 4's nibbles and the top 2 bits
    // of bytes j - 4 and j).
    const __m512i head = rows.gather(0);
    const __m512i low = rows.gather(4), mid = rows.gather(8), high = rows.gather(12);
    const __m512 d = fp16_lanes(head, false), dmin = fp16_lanes(head, true);
    for (int j = 0; j < 4; ++j) {
      const __m512i sc =
          _mm512_or_si512(lane_bits(high, 8 * j, 15), _mm512_slli_epi32(lane_bits(low, 8 * j + 6, 3), 4));
      const __m512i mn =
          _mm512_or_si512(lane_bits(high, 8 * j + 4, 15), _mm512_slli_epi32(lane_bits(mid, 8 * j + 6, 3), 4));
      scales[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(lane_bits(low, 8 * j, 63)));
      mins[j] = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(lane_bits(mid, 8 * j, 63)));
      scales[j + 4] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
      mins[j + 4] = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mn));
    }
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {  // 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high ones
      __m256i packed[kLaneRows];
      for (int r = 0; r < kLaneRows; ++r) packed[r] = rows.load32(r, 16 + 32 * c);
      __m512i groups[8];
      transpose_16x8_dwords(packed, groups);
      for (int g = 0; g < 8; ++g) {
        quants[2 * c][g] = _mm512_and_si512(groups[g], nibble);
        quants[2 * c + 1][g] = _mm512_and_si512(_mm512_srli_epi16(groups[g], 4), nibble);
      }
    }
  }

  // acc[m] += this block (block b of the row) against x row m: d_x sum_j (d sc_j) dot_j - sum_j (dmin m_j) (d_x
  // sum(q_x_j)).
  template <int MT>
  void accumulate(const QuantRows& x, int64_t b, __m512* acc) const {
    __m512 block_sum[MT];
    for (int m = 0; m < MT; ++m) block_sum[m] = _mm512_setzero_ps();
    for (int j = 0; j < 8; ++j) {
      __m512i dots[MT];
      for (int m = 0; m < MT; ++m) dots[m] = _mm512_setzero_si512();
      for (int g = 0; g < 8; ++g)
        for (int m = 0; m < MT; ++m)
          dots[m] = _mm512_dpbusd_epi32(dots[m], quants[j][g],
                                        broadcast4(x.quants + m * x.quant_stride + b * 256 + 32 * j + 4 * g));
      for (int m = 0; m < MT; ++m) {
        block_sum[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[m]), scales[j], block_sum[m]);
        acc[m] = _mm512_fnmadd_ps(mins[j], _mm512_set1_ps(x.scaled_sums[m * (x.sum_stride / 2) + b * 8 + j]), acc[m]);
      }
    }
    for (int m = 0; m < MT; ++m)
      acc[m] = _mm512_fmadd_ps(block_sum[m], _mm512_set1_ps(x.scales[m * x.scale_stride + b]), acc[m]);
  }
};

struct Q6_KTile {
  static constexpr int kElements = 256, kBytes = 210;
  __m512i quants[16][4];  // [group G of 16][i]: lane r = quants 16 G + 4 i .. 16 G + 4 i + 3 of row r (0-63)
  __m512 scales[16];      // lane r: d * sc_G of row r

  void repack(const TileRows& rows) {
    // The 16 int8 scales (bytes 192-207) and d (208-209), lanes = rows; d read as the top half of bytes 206-209
    // (a dword at 208 would read past the block).
    const __m512 d = fp16_lanes(rows.gather(206), true);
    for (int q = 0; q < 4; ++q) {
      const __m512i words = rows.gather(192 + 4 * q);
      for (int i = 0; i < 4; ++i) {  // byte i, sign-extended: shifted to the top, then arithmetically down
        const __m512i sc = _mm512_srai_epi32(_mm512_slli_epi32(words, static_cast<unsigned>(24 - 8 * i)), 24);
        scales[4 * q + i] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
      }
    }
    const __m256i bits45 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
      __m256i packed[4][kLaneRows];  // [p][r]: quants 128 h + 32 p + [0, 32) of row r, as in the GEMV's Q6_K block
      for (int r = 0; r < kLaneRows; ++r) {
        const __m256i ql0 = rows.load32(r, 64 * h), ql1 = rows.load32(r, 64 * h + 32);
        const __m256i qh = rows.load32(r, 128 + 32 * h);
        packed[0][r] = _mm256_or_si256(low_nibbles(ql0), _mm256_and_si256(_mm256_slli_epi16(qh, 4), bits45));
        packed[1][r] = _mm256_or_si256(low_nibbles(ql1), _mm256_and_si256(_mm256_slli_epi16(qh, 2), bits45));
        packed[2][r] = _mm256_or_si256(high_nibbles(ql0), _mm256_and_si256(qh, bits45));
        packed[3][r] = _mm256_or_si256(high_nibbles(ql1), _mm256_and_si256(_mm256_srli_epi16(qh, 2), bits45));
      }
      for (int p = 0; p < 4; ++p) {
        __m512i groups[8];
        transpose_16x8_dwords(packed[p], groups);
        for (int g = 0; g < 8; ++g) quants[8 * h + 2 * p + g / 4][g % 4] = groups[g];
      }
    }
  }

  // acc[m] += d_x sum_G (d sc_G) (dot_G - 32 sum(q_x_G)) for this block against x row m.
  template <int MT>
  void accumulate(const QuantRows& x, int64_t b, __m512* acc) const {
    __m512 block_sum[MT];
    for (int m = 0; m < MT; ++m) block_sum[m] = _mm512_setzero_ps();
    for (int g = 0; g < 16; ++g) {
      __m512i dots[MT];
      for (int m = 0; m < MT; ++m) dots[m] = _mm512_set1_epi32(-32 * x.sums[m * x.sum_stride + b * 16 + g]);
      for (int i = 0; i < 4; ++i)
        for (int m = 0; m < MT; ++m)
          dots[m] = _mm512_dpbusd_epi32(dots[m], quants[g][i],
                                        broadcast4(x.quants + m * x.quant_stride + b * 256 + 16 * g + 4 * i));
      for (int m = 0; m < MT; ++m)
        block_sum[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[m]), scales[g], block_sum[m]);
    }
    for (int m = 0; m < MT; ++m)
      acc[m] = _mm512_fmadd_ps(block_sum[m], _mm512_set1_ps(x.scales[m * x.scale_stride + b]), acc[m]);
  }
};

// out[g] lane r = dword g of rows[r] (16 rows of 4 dwords).
inline void transpose_16x4_dwords(const __m128i rows[16], __m512i out[4]) {
  __m512i z[4], t[4];
  // z[p]: rows p, p + 4, p + 8, p + 12 in its four 128-bit lanes; then a 4 x 4 transpose within each lane.
  for (int p = 0; p < 4; ++p) {
    const __m256i low = _mm256_inserti128_si256(_mm256_castsi128_si256(rows[p]), rows[p + 4], 1);
    const __m256i high = _mm256_inserti128_si256(_mm256_castsi128_si256(rows[p + 8]), rows[p + 12], 1);
    z[p] = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
  }
  t[0] = _mm512_unpacklo_epi32(z[0], z[1]);
  t[1] = _mm512_unpackhi_epi32(z[0], z[1]);
  t[2] = _mm512_unpacklo_epi32(z[2], z[3]);
  t[3] = _mm512_unpackhi_epi32(z[2], z[3]);
  out[0] = _mm512_unpacklo_epi64(t[0], t[2]);
  out[1] = _mm512_unpackhi_epi64(t[0], t[2]);
  out[2] = _mm512_unpacklo_epi64(t[1], t[3]);
  out[3] = _mm512_unpackhi_epi64(t[1], t[3]);
}

struct Q4_0Tile {
  static constexpr int kElements = 32, kBytes = 18;
  __m512i quants[8];  // [group g]: lane r = quants 4 g .. 4 g + 3 of row r (u8 0-15; the -8 is x's side)
  __m512 scales;      // lane r: d of row r

  void repack(const TileRows& rows) {
    scales = fp16_lanes(rows.gather(0), false);
    __m128i packed[kLaneRows];  // elements 0-15 in the low nibbles, 16-31 in the high ones
    for (int r = 0; r < kLaneRows; ++r)
      packed[r] = r < rows.count ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows.row(r) + 2))
                                 : _mm_setzero_si128();
    __m512i groups[4];
    transpose_16x4_dwords(packed, groups);
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int g = 0; g < 4; ++g) {
      quants[g] = _mm512_and_si512(groups[g], nibble);
      quants[g + 4] = _mm512_and_si512(_mm512_srli_epi16(groups[g], 4), nibble);
    }
  }

  // acc[m] += d_x (d (dot - 8 sum(q_x))) for this block against x row m (x quantized per 32, as the GEMV's).
  template <int MT>
  void accumulate(const QuantRows& x, int64_t b, __m512* acc) const {
    __m512i dots[MT];
    for (int m = 0; m < MT; ++m) {
      const int16_t* sums = x.sums + m * x.sum_stride + 2 * b;
      dots[m] = _mm512_set1_epi32(-8 * (sums[0] + sums[1]));
    }
    for (int g = 0; g < 8; ++g)
      for (int m = 0; m < MT; ++m)
        dots[m] = _mm512_dpbusd_epi32(dots[m], quants[g], broadcast4(x.quants + m * x.quant_stride + 32 * b + 4 * g));
    for (int m = 0; m < MT; ++m)
      acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dots[m]), scales),
                               _mm512_set1_ps(x.scales[m * x.scale_stride + b]), acc[m]);
  }
};

// A repacked tile (rows [n0, n0 + rows)) against x rows [m0, m0 + MT): y[m, n0 + r] for the first `rows` lanes.
template <class Tile, int MT>
void tile_pass(const Tile* tile, int64_t num_blocks, const QuantRows& x, int64_t m0, int64_t n0, int rows,
               const float* bias, float* y, int64_t N) {
  const QuantRows xr = x.at(m0);
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) tile[b].template accumulate<MT>(xr, b, acc);
  const __mmask16 mask = tail_mask(rows);
  const __m512 bias_lanes = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int m = 0; m < MT; ++m)
    _mm512_mask_storeu_ps(y + (m0 + m) * N + n0, mask, _mm512_add_ps(acc[m], bias_lanes));
}

template <class Tile>
void interleaved_tiles(const QuantRows& x, int64_t M, int64_t K, const uint8_t* w, int64_t N, const float* bias,
                       float* y, int num_threads) {
  const int64_t num_blocks = K / Tile::kElements, row_bytes = num_blocks * Tile::kBytes;
  const int64_t num_tiles = (N + kLaneRows - 1) / kLaneRows;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, num_tiles)));
#pragma omp parallel num_threads(threads)
  {
    int64_t begin, end;
    thread_range(num_tiles, omp_get_thread_num(), omp_get_num_threads(), begin, end);
    std::vector<Tile> tile(static_cast<size_t>(num_blocks));
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kLaneRows;
      const int rows = static_cast<int>(std::min<int64_t>(kLaneRows, N - n0));
      for (int64_t b = 0; b < num_blocks; ++b)
        tile[b].repack(TileRows{w + n0 * row_bytes + b * Tile::kBytes, row_bytes, rows});
      int64_t m = 0;
      for (; m + kLaneMT <= M; m += kLaneMT)
        tile_pass<Tile, kLaneMT>(tile.data(), num_blocks, x, m, n0, rows, bias, y, N);
      with_count<kLaneMT - 1>(M - m, [&](auto count) {
        tile_pass<Tile, decltype(count)::value>(tile.data(), num_blocks, x, m, n0, rows, bias, y, N);
      });
    }
  }
}

}  // namespace

void interleaved_product(int type, const QuantRows& x, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                         const float* bias, float* y, int num_threads) {
  switch (type) {
    case kGgmlQ4_0: interleaved_tiles<Q4_0Tile>(x, M, K, w, N, bias, y, num_threads); break;
    case kGgmlQ4_K: interleaved_tiles<Q4_KTile>(x, M, K, w, N, bias, y, num_threads); break;
    default: interleaved_tiles<Q6_KTile>(x, M, K, w, N, bias, y, num_threads); break;
  }
}

}  // namespace quant
}  // namespace kvflow
#endif  // KVFLOW_QUANT_VNNI
