// GEMM mode of the K-block kernel's AVX2 build: many activation rows (batched decode steps, prefill chunks) against
// one tile of 16 weight rows. kblock_tiles.h's tile_dot unpacks a block's codes for every pass of MAX_MR (2) rows,
// since 16 ymm registers hold no more; here a thread unpacks the whole tile once into a buffer that stays in L1/L2
// (8 code vectors and the group scales per block and half tile, unpack_half's output as it is), and then every
// activation row passes it, MR = 4 rows at a time: a code vector is loaded once per 4 rows, each row's int16 sums
// run over a whole group before one madd, and no accumulator spills. The integer sums are exact and the float
// steps are tile_dot's (block_step), so a row's result is bitwise tile_dot's whatever the number of rows: the
// kernel stays batch-invariant.
//
// Operands per kind (maddubs multiplies unsigned codes by signed int8 activations, pairs into saturating int16):
//   4-bit codes (Q4_1, Q4_K; and Q2_K / Q3_K, 2 and 3 bits in 4): <= 15, so a whole block's 16 products per
//     int16 lane stay <= 30480: one int16 sum per group of 16 or 32 weights;
//   5-bit codes (Q5_0, Q5_1, Q5_K): <= 31, 8 products per lane <= 31496: one int16 sum per half block;
//   6-bit codes (Q6_K): <= 63, 4 products <= 32004: one int16 sum per quarter block;
//   Q8_0 (a part of a stack): the stored byte - 128 = q, and maddubs(|q|, sign(x, q)) (<= 2·128·127 per pair).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <vector>

namespace kb {

// what the buffer holds per (half tile, block), in 32-byte vectors: 8 code vectors, then s0 [, s1] [, n0 [, n1]]
template <class K>
struct GemmBuf {
  static constexpr int NS = K::GPB;                      // scale vectors
  static constexpr int NM = K::MIN ? K::GPB : 0;         // min vectors
  static constexpr int64_t STRIDE = 8 + NS + NM;         // vectors per (half, block)
};

// The tile's blocks unpacked into buf [2][nb][STRIDE] (half-major); Q8_0 codes stored as q = u - 128.
template <class K>
inline void unpack_tile(const uint8_t* tc, const uint8_t* tm, int64_t R, int64_t nb, __m256i* buf) {
  using B = GemmBuf<K>;
  const TileMeta<K> meta(tm, R, nb);
  for (int64_t h = 0; h * 8 < R; ++h) {
    const int64_t n = std::min<int64_t>(8, R - 8 * h);
    __m256 dv = _mm256_setzero_ps(), dmv = _mm256_setzero_ps();
    __m256i hw = _mm256_setzero_si256();
    for (int64_t b = 0; b < nb; ++b) {
      __m256i lo[4], hi[4];
      __m256 s0, s1, n0, n1;
      unpack_half<K>(tc, meta, R, 8 * h, n, b, lo, hi, s0, s1, n0, n1, dv, dmv, hw, _mm256_set1_epi8(0x0F),
                     _mm256_set1_epi8(0x30));
      __m256i* p = buf + (h * nb + b) * B::STRIDE;
      const __m256i flip = _mm256_set1_epi8(static_cast<char>(K::BITS == 8 ? 0x80 : 0));
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {  // in activation order: vector j multiplies bytes 4j .. 4j + 3
        p[2 * g] = _mm256_xor_si256(lo[g], flip);
        p[2 * g + 1] = _mm256_xor_si256(hi[g], flip);
      }
      p[8] = _mm256_castps_si256(s0);
      if constexpr (K::GPB == 2) p[9] = _mm256_castps_si256(s1);
      if constexpr (K::MIN) {
        p[8 + B::NS] = _mm256_castps_si256(n0);
        if constexpr (K::GPB == 2) p[9 + B::NS] = _mm256_castps_si256(n1);
      }
    }
  }
}

inline __m256i bcast4(const int8_t* p) { return _mm256_set1_epi32(bytes4(p)); }

// Keeps v in a register as it is: without it GCC re-associates the running sums into a tree of all 32 products
// of a block, which spills most of them (and the accumulators) to the stack, ~1.5x slower.
#define KB_PIN(v) asm("" : "+x"(v))

// Activation rows m0 .. m0 + MR against half h of the unpacked tile (n outputs); y points at the half's first column.
template <class K, int MR>
inline void gemm_rows(const __m256i* buf, int64_t nb, int64_t h, int64_t n, const Acts& a, int64_t m0, float* y,
                      int64_t N) {
  using B = GemmBuf<K>;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  const int8_t* xr[MR];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) xr[i] = a.xq + (m0 + i) * nb * 32;
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i* p = buf + (h * nb + b) * B::STRIDE;
    __m256i sa[MR], sb[MR];
    if constexpr (K::BITS == 8) {
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) sa[i] = sb[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m256i q = p[j], u = _mm256_abs_epi8(q);
#pragma GCC unroll 4
        for (int i = 0; i < MR; ++i) {
          const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_sign_epi8(bcast4(xr[i] + b * 32 + 4 * j), q)),
                                              ones);
          if (j < 4) {
            sa[i] = _mm256_add_epi32(sa[i], s);
            KB_PIN(sa[i]);
          } else {
            sb[i] = _mm256_add_epi32(sb[i], s);
            KB_PIN(sb[i]);
          }
        }
      }
    } else if constexpr (K::BITS == 4 && K::GPB == 1) {  // one int16 sum over the whole block
      __m256i s16[MR];
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) s16[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m256i c = p[j];
#pragma GCC unroll 4
        for (int i = 0; i < MR; ++i)
        {
          s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(c, bcast4(xr[i] + b * 32 + 4 * j)));
          KB_PIN(s16[i]);
        }
      }
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) {
        sa[i] = _mm256_madd_epi16(s16[i], ones);
        sb[i] = _mm256_setzero_si256();
      }
    } else {  // int16 sums over runs of L code vectors (4-bit G = 16 and 5-bit: 4; 6-bit: 2), widened after each
      constexpr int L = K::BITS == 6 ? 2 : 4;
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) sa[i] = sb[i] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int r = 0; r < 8 / L; ++r) {
        __m256i s16[MR];
#pragma GCC unroll 4
        for (int i = 0; i < MR; ++i) s16[i] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int j = r * L; j < (r + 1) * L; ++j) {
          const __m256i c = p[j];
#pragma GCC unroll 4
          for (int i = 0; i < MR; ++i) {
            s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(c, bcast4(xr[i] + b * 32 + 4 * j)));
            KB_PIN(s16[i]);
          }
        }
#pragma GCC unroll 4
        for (int i = 0; i < MR; ++i) {
          const __m256i w = _mm256_madd_epi16(s16[i], ones);
          if (r * L < 4)
            sa[i] = _mm256_add_epi32(sa[i], w);
          else
            sb[i] = _mm256_add_epi32(sb[i], w);
        }
      }
    }
    const __m256 s0 = _mm256_castsi256_ps(p[8]);
    const __m256 s1 = K::GPB == 2 ? _mm256_castsi256_ps(p[9]) : s0;
    const __m256 n0 = K::MIN ? _mm256_castsi256_ps(p[8 + B::NS]) : s0;
    const __m256 n1 = K::MIN && K::GPB == 2 ? _mm256_castsi256_ps(p[9 + B::NS]) : n0;
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const int64_t row = (m0 + i) * nb + b;
      if constexpr (K::OFF != 0 && K::BITS != 8) {
        sa[i] = _mm256_add_epi32(sa[i], _mm256_set1_epi32(a.xo[2 * row]));
        sb[i] = _mm256_add_epi32(sb[i], _mm256_set1_epi32(a.xo[2 * row + 1]));
      }
      acc[i] = block_step<K>(acc[i], sa[i], sb[i], s0, s1, n0, n1, a, row);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) store_rows(y + (m0 + i) * N, acc[i], n);
}



// Rows m0 .. m1 against one tile: unpacked once into the calling thread's buffer, then 4 rows at a time.
template <class K>
inline void gemm_tile(const uint8_t* tc, const uint8_t* tm, int64_t R, const Acts& a, int64_t m0, int64_t m1,
                      float* y, int64_t N) {
  static thread_local std::vector<__m256i> buf;
  const int64_t need = 2 * a.nb * GemmBuf<K>::STRIDE;
  if (static_cast<int64_t>(buf.size()) < need) buf.resize(need);
  unpack_tile<K>(tc, tm, R, a.nb, buf.data());
  for (int64_t h = 0; h * 8 < R; ++h) {
    const int64_t n = std::min<int64_t>(8, R - 8 * h);
    float* yh = y + 8 * h;
    int64_t m = m0;
    for (; m + 4 <= m1; m += 4) gemm_rows<K, 4>(buf.data(), a.nb, h, n, a, m, yh, N);
    switch (m1 - m) {
      case 3: gemm_rows<K, 3>(buf.data(), a.nb, h, n, a, m, yh, N); break;
      case 2: gemm_rows<K, 2>(buf.data(), a.nb, h, n, a, m, yh, N); break;
      case 1: gemm_rows<K, 1>(buf.data(), a.nb, h, n, a, m, yh, N); break;
      default: break;
    }
  }
}

#undef KB_PIN

}  // namespace kb
