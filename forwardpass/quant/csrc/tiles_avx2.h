// The small-batch matmul of the AVX2 build on weights in the tile layout (tile_layout.h): the VNNI build's tile
// kernel (tiles.h) for CPUs without AVX-512 (AMD Zen 2/3, Intel before Ice Lake).
//
// Why the layout helps here too: in the GGUF layout a register holds 32 consecutive k of ONE weight row, so each
// block of 32 products costs two sign operations, maddubs, madd, a convert, a scale broadcast and an FMA, and each
// row ends in a horizontal sum. Here one 32-byte load holds 4 consecutive k of 8 rows (half of a tile's 64-byte
// group): the lanes are 8 OUTPUTS and each lane's int32 sum runs over a whole block before one convert and FMA.
//
// maddubs multiplies unsigned by signed bytes and adds pairs into saturating int16, so the operands are chosen to
// never saturate:
//   Q8_0: |w| (unsigned; -128 becomes 128) times x carrying w's sign (llama.cpp's trick; x is never -128):
//         pairs ≤ 2·128·127 < 2^15; then madd by 1 into int32 per group of 4 k. Per 32 products: sign, maddubs,
//         madd, add (|w| once per weight vector, for every activation row).
//   Q4_0: the stored nibbles q = w + 8 (0..15, unsigned) times x: pairs ≤ 2·15·127, so a whole block's 8 maddubs
//         add up in int16 (≤ 30480) and one madd per block widens them; xc = -8 · Σ block cancels the offset.
// The block sums are exact integers, and the float operations are the GEMM's (vnni_gemm.h) one for one: blocks in
// sequence, one FMA each with the float32 product d_w · d_x. So results are bitwise the VNNI build's tile kernel
// and reference.quant_gemm_exact's.
#pragma once

#include "tile_layout.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace tiles {

// 4 activation bytes (k .. k+3) in every 32-bit lane (memcpy: no aliasing of int8 as int32; one broadcast load)
inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// the lanes of rows 0..rows-1 of a half tile, as maskload/maskstore want them (sign bit set)
inline __m256i row_mask(int64_t rows) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(rows)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// 8 rows' 4-byte groups (rows ≥ `rows` read as zeros)
inline __m256i load_rows(const uint8_t* p, int64_t rows, __m256i mask) {
  return rows == 8 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                   : _mm256_maskload_epi32(reinterpret_cast<const int*>(p), mask);
}

// 8 rows' fp16 scales as floats (rows ≥ `rows` zero)
inline __m256 load_scales(const at::Half* p, int64_t rows) {
  if (rows == 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  alignas(16) uint16_t buf[8] = {};
  std::memcpy(buf, p, rows * sizeof(uint16_t));
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(buf)));
}

// Activation rows m0..m0+MR against halves h0..h0+H of one tile (half h: the tile's rows 8h..8h+7).
// xq [M, nb·32] int8, xd [M, nb] scales, xc [M, nb] -8 · Σ block (read for Q4_0 only).
template <bool Q4, int MR, int H>
inline void halves(const uint8_t* tw, const at::Half* td, int64_t R, int64_t nb, const int8_t* xq, const float* xd,
                   const int32_t* xc, int64_t m0, float* y, int64_t N, int64_t n0, int h0) {
  const int64_t group = R * 4;  // bytes per 4-byte group of all R rows
  int64_t rows[H];
  __m256i mask[H];
  __m256 acc[MR][H];
  for (int h = 0; h < H; ++h) {
    rows[h] = std::clamp<int64_t>(R - 8 * (h0 + h), 0, 8);
    mask[h] = row_mask(rows[h]);
    for (int i = 0; i < MR; ++i) acc[i][h] = _mm256_setzero_ps();
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = tw + b * (Q4 ? 4 : 8) * group + 32 * h0;
    __m256i sum[MR][H];
    if constexpr (Q4) {
      const __m256i low = _mm256_set1_epi8(0x0F);
      __m256i s16[MR][H];
      for (int i = 0; i < MR; ++i)
        for (int h = 0; h < H; ++h) s16[i][h] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        for (int h = 0; h < H; ++h) {
          const __m256i v = load_rows(p + g * group + 32 * h, rows[h], mask[h]);
          const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
#pragma GCC unroll 4
          for (int i = 0; i < MR; ++i) {
            const int8_t* xb = xq + (m0 + i) * nb * QK + b * QK + 8 * g;
            s16[i][h] = _mm256_add_epi16(s16[i][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast4(xb)),
                                                                      _mm256_maddubs_epi16(hi, broadcast4(xb + 4))));
          }
        }
      }
      for (int i = 0; i < MR; ++i) {
        const __m256i start = _mm256_set1_epi32(xc[(m0 + i) * nb + b]);
        for (int h = 0; h < H; ++h) sum[i][h] = _mm256_add_epi32(start, _mm256_madd_epi16(s16[i][h], ones));
      }
    } else {
      for (int i = 0; i < MR; ++i)
        for (int h = 0; h < H; ++h) sum[i][h] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
        __m256i xs[MR];
        for (int i = 0; i < MR; ++i) xs[i] = broadcast4(xq + (m0 + i) * nb * QK + b * QK + 4 * g);
        for (int h = 0; h < H; ++h) {
          const __m256i w = load_rows(p + g * group + 32 * h, rows[h], mask[h]);
          const __m256i wa = _mm256_abs_epi8(w);
#pragma GCC unroll 4
          for (int i = 0; i < MR; ++i)
            sum[i][h] = _mm256_add_epi32(
                sum[i][h], _mm256_madd_epi16(_mm256_maddubs_epi16(wa, _mm256_sign_epi8(xs[i], w)), ones));
        }
      }
    }
    for (int h = 0; h < H; ++h) {
      const __m256 dw = load_scales(td + b * R + 8 * (h0 + h), rows[h]);
      for (int i = 0; i < MR; ++i)
        acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[i][h]), _mm256_mul_ps(dw, _mm256_set1_ps(xd[(m0 + i) * nb + b])),
                                    acc[i][h]);
    }
  }
  for (int h = 0; h < H; ++h) {
    if (rows[h] == 0) continue;
    for (int i = 0; i < MR; ++i) {
      float* out = y + (m0 + i) * N + n0 + 8 * (h0 + h);
      if (rows[h] == 8) {
        _mm256_storeu_ps(out, acc[i][h]);
      } else {
        _mm256_maskstore_ps(out, mask[h], acc[i][h]);
      }
    }
  }
}

// Activation rows m0..m0+MR against one tile of R rows: both halves in one pass for up to 2 rows (16 registers
// hold their accumulators), one half per pass for more.
template <bool Q4, int MR>
inline void tile_rows(const uint8_t* tw, const at::Half* td, int64_t R, int64_t nb, const int8_t* xq,
                      const float* xd, const int32_t* xc, int64_t m0, float* y, int64_t N, int64_t n0) {
  if constexpr (MR <= 2) {
    if (R > 8) {
      halves<Q4, MR, 2>(tw, td, R, nb, xq, xd, xc, m0, y, N, n0, 0);
    } else {
      halves<Q4, MR, 1>(tw, td, R, nb, xq, xd, xc, m0, y, N, n0, 0);
    }
  } else {
    halves<Q4, MR, 1>(tw, td, R, nb, xq, xd, xc, m0, y, N, n0, 0);
    if (R > 8) halves<Q4, MR, 1>(tw, td, R, nb, xq, xd, xc, m0, y, N, n0, 1);
  }
}

}  // namespace tiles
