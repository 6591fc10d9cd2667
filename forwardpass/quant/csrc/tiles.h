// The small-batch matmul of the AVX-512 VNNI build on weights in the tile layout (tile_layout.h): one tile against
// a group of activation rows (tile_rows); quant_matmul.cpp hands the tiles out over the threads (over_tiles).
//
// The GGUF layout keeps each weight row's blocks together, so a vector register holds 32-64 consecutive k of
// ONE row: every vpdpbusd (64 products) is followed by a convert, a scale permute and an FMA, and the 16 lanes
// are summed at the end. The tile layout reorders the same bytes, 16 rows at a time, so that one 64-byte load
// holds 4 consecutive k of 16 rows: the lanes are 16 OUTPUTS, each lane's int32 sum runs over a whole block
// (8 vpdpbusd), and only then comes one convert, scale and FMA per block of 32 k — the GEMM's register layout
// (vnni_gemm.h) stored ahead of time. Measured from cache on a Zen 4 core pair: 2x the GGUF-layout kernel's
// rate for Q8_0, 2.4x for Q4_0; decode reads memory, so end to end it is less (forwardpass/quant/tiles.py).
//
// The layout's offsets: tile_layout.h.
#pragma once

#include "tile_layout.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace tiles {

// the lanes a tile of R rows fills (R = 0: none, for a panel's vector past the last tile)
inline __mmask16 lanes(int64_t R) { return static_cast<__mmask16>((1u << R) - 1); }

// 4 activation bytes (k .. k+3) in every lane (memcpy: an int8 array read as int32 without breaking aliasing rules;
// compiles to one broadcast load)
inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Activation rows m0..m0+MR against one tile: y[m][n0 + r] for its R rows. xq [M, nb·32] int8, xd [M, nb]
// scales, xc [M, nb] the int32 starting values -offset · Σ block (the GEMM's activations: the weights are made
// unsigned by +128 (Q8_0, an xor) or are the stored nibbles q = w + 8 (Q4_0), and xc cancels the offset).
// The same float operations as the GEMM (blocks in sequence, one FMA each with the float32 product d_w · d_x),
// so a row's result does not depend on which of the two computed it.
template <bool Q4, int MR>
inline void tile_rows(const uint8_t* tw, const at::Half* td, int64_t R, int64_t nb, const int8_t* xq,
                      const float* xd, const int32_t* xc, int64_t m0, float* y, int64_t N, int64_t n0) {
  const __mmask16 mask = lanes(R);
  const int64_t group = R * 4;  // bytes per 4-byte group of all R rows
  __m512 acc[MR];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = tw + b * (Q4 ? 4 : 8) * group;
    __m512i s0[MR], s1[MR];  // two dependency chains per row, added at the end of the block (exact int32)
    const int8_t* xb[MR];
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      s0[i] = _mm512_set1_epi32(xc[(m0 + i) * nb + b]);
      s1[i] = _mm512_setzero_si512();
      xb[i] = xq + (m0 + i) * nb * QK + b * QK;
    }
    if constexpr (Q4) {
      const __m512i low = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        const __m512i v = _mm512_maskz_loadu_epi32(mask, p + g * group);
        const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
#pragma GCC unroll 4
        for (int i = 0; i < MR; ++i) {
          s0[i] = _mm512_dpbusd_epi32(s0[i], lo, broadcast4(xb[i] + 8 * g));
          s1[i] = _mm512_dpbusd_epi32(s1[i], hi, broadcast4(xb[i] + 8 * g + 4));
        }
      }
    } else {
      const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
#pragma GCC unroll 8
      for (int q = 0; q < 8; q += 2) {
        const __m512i v0 = _mm512_xor_si512(_mm512_maskz_loadu_epi32(mask, p + q * group), offset);
        const __m512i v1 = _mm512_xor_si512(_mm512_maskz_loadu_epi32(mask, p + (q + 1) * group), offset);
#pragma GCC unroll 4
        for (int i = 0; i < MR; ++i) {
          s0[i] = _mm512_dpbusd_epi32(s0[i], v0, broadcast4(xb[i] + 4 * q));
          s1[i] = _mm512_dpbusd_epi32(s1[i], v1, broadcast4(xb[i] + 4 * q + 4));
        }
      }
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, td + b * R));
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i)
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0[i], s1[i])),
                               _mm512_mul_ps(dw, _mm512_set1_ps(xd[(m0 + i) * nb + b])), acc[i]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) _mm512_mask_storeu_ps(y + (m0 + i) * N + n0, mask, acc[i]);
}

}  // namespace tiles
