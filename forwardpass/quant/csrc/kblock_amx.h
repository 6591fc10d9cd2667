// The K-block kernel's integer sums from AMX's tile unit, 16 activation rows per pass, for batches of 9-31 rows
// (speculative decoding's verify rows, small decode batches; from 32 rows on a GEMM takes over). The VNNI loop (kblock_tiles.h::tile_dot) spends 8 vpdpbusd per block of
// 32 weights per activation row on one port: verifying k + 1 rows costs about k + 1 times the arithmetic of one.
// Here a block of a 16-row weight tile is unpacked once (unpack_block, the VNNI loop's own code), stored as an
// int8 B tile (field j of the 16 rows — weights 4j..4j+3 of each — is B's row j: the tile layout is AMX's), and
// one tdpbsud (signed activations × unsigned codes) gives every activation row's sums for the block at once.
// The sums are the VNNI loop's exactly (integers), and everything after them — the code offset, the convert, the
// FMAs with the same scales in the same order — is the VNNI loop's, so the outputs are bitwise equal. The cost is
// a round trip per block (tile store, vector reload: the scales change every 32 weights, so no sums stay in a
// tile), which four blocks in flight overlap; below 9 rows it still outweighs the saved dot products.
#pragma once
#include <cpuid.h>
#include <immintrin.h>

#include "amx_state.h"
#include "kblock_tiles.h"

namespace kb {

constexpr int64_t AMX_ROWS = 16;  // activation rows per tile pass (the tile's rows)

// The CPU has AMX-INT8 and Linux lets this process use the tile state (it must be asked: ARCH_REQ_XCOMP_PERM).
inline bool amx_int8_usable() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1) || !((d >> 25) & 1)) return false;
    return amx::request_amx();
  }();
  return ok;
}

// Tiles 0-3: the sums of four groups in flight (16 rows × 16 int32 each: a round of 4 blocks of one group, or 2
// of two); 4, 5: activations (16 rows × G bytes), 6, 7: codes (G / 4 rows × 64 bytes), alternating so that one
// group's loads need not wait for the previous product. Tile state is per thread: each thread loads this.
template <class K>
inline void amx_configure() {
  amx::TileConfig cfg;
  for (int t = 0; t < 4; ++t) {
    cfg.rows[t] = AMX_ROWS;
    cfg.colsb[t] = 64;
  }
  for (int t = 4; t < 6; ++t) {
    cfg.rows[t] = AMX_ROWS;
    cfg.colsb[t] = K::G;
    cfg.rows[t + 2] = K::G / 4;
    cfg.colsb[t + 2] = 64;
  }
  _tile_loadconfig(&cfg);
}

// One group's product into sum tile D through activation tile A and code tile B: activations at xa (row stride
// `stride`), codes at w (64 bytes per B row), the sums stored at out. A macro: the intrinsics paste the tile
// numbers into their assembly, so they must be literal digits.
#define KB_AMX_GROUP(D, A, B, xa, stride, w, out) \
  do {                                             \
    _tile_zero(D);                                 \
    _tile_loadd(A, xa, stride);                    \
    _tile_loadd(B, w, 64);                         \
    _tile_dpbsud(D, A, B);                         \
    _tile_stored(D, out, 64);                      \
  } while (0)

// Rows m0 .. m0 + rows - 1 (rows <= 16) of y against one tile of R weight rows; a.xq must hold 16 readable rows
// from m0 on (kblock_matmul.cpp pads it with zero rows). Blocks go in rounds of 4 groups: their products are
// issued together, so their latencies overlap, then the VNNI loop's float steps run block by block.
template <class K>
inline void amx_tile_rows(const uint8_t* tc, const uint8_t* tm, int64_t R, const Acts& a, int64_t m0, int64_t rows,
                          float* y, int64_t N) {
  constexpr int BPR = 4 / K::GPB;  // blocks per round
  const int64_t nb = a.nb, stride = nb * 32;
  const __mmask16 mask = static_cast<__mmask16>((1u << R) - 1);
  const TileMeta<K> meta(tm, R, nb);
  alignas(64) uint8_t codes[BPR][8][64];
  alignas(64) int32_t sums[4][AMX_ROWS][16];
  alignas(64) float acc[AMX_ROWS][16];
  __m512 scale[BPR][4];  // s0, s1, n0, n1 of each block of the round
  for (int64_t i = 0; i < rows; ++i) _mm512_store_ps(acc[i], _mm512_setzero_ps());
  Block512 f;
  for (int64_t b0 = 0; b0 < nb; b0 += BPR) {
    const int n = static_cast<int>(std::min<int64_t>(BPR, nb - b0));
    for (int j = 0; j < n; ++j) {
      unpack_block<K>(tc, meta, R, mask, b0 + j, f);
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {  // field 2g: lo[g], weights 8g..8g+3; field 2g + 1: hi[g]
        _mm512_store_si512(codes[j][2 * g], f.lo[g]);
        _mm512_store_si512(codes[j][2 * g + 1], f.hi[g]);
      }
      scale[j][0] = f.s0, scale[j][1] = f.s1, scale[j][2] = f.n0, scale[j][3] = f.n1;
    }
    const int8_t* xa = a.xq + m0 * stride + b0 * 32;
    if constexpr (K::GPB == 1) {  // group d: block d
      KB_AMX_GROUP(0, 4, 6, xa, stride, codes[0][0], sums[0][0]);
      if (n > 1) KB_AMX_GROUP(1, 5, 7, xa + 32, stride, codes[1][0], sums[1][0]);
      if (n > 2) KB_AMX_GROUP(2, 4, 6, xa + 64, stride, codes[2 % BPR][0], sums[2][0]);
      if (n > 3) KB_AMX_GROUP(3, 5, 7, xa + 96, stride, codes[3 % BPR][0], sums[3][0]);
    } else {  // groups 2j, 2j + 1: the halves of block j
      KB_AMX_GROUP(0, 4, 6, xa, stride, codes[0][0], sums[0][0]);
      KB_AMX_GROUP(1, 5, 7, xa + 16, stride, codes[0][4], sums[1][0]);
      if (n > 1) {
        KB_AMX_GROUP(2, 4, 6, xa + 32, stride, codes[1 % BPR][0], sums[2][0]);
        KB_AMX_GROUP(3, 5, 7, xa + 48, stride, codes[1 % BPR][4], sums[3][0]);
      }
    }
    for (int64_t i = 0; i < rows; ++i) {
      __m512 v = _mm512_load_ps(acc[i]);
      for (int j = 0; j < n; ++j) {
        const int64_t row = (m0 + i) * nb + b0 + j;
        const __m512 dx = _mm512_set1_ps(a.xd[row]);
        // the VNNI loop's sums: each half starts at its -OFF·Σx, then adds its dot products (int32, exact)
        const int32_t o0 = K::OFF ? a.xo[2 * row] : 0, o1 = K::OFF ? a.xo[2 * row + 1] : 0;
        if constexpr (K::GPB == 1) {
          const __m512i s = _mm512_add_epi32(_mm512_add_epi32(_mm512_set1_epi32(o0), _mm512_load_si512(sums[j][i])),
                                             _mm512_set1_epi32(o1));
          v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(scale[j][0], dx), v);
          if constexpr (K::MIN) v = _mm512_fmadd_ps(scale[j][2], _mm512_set1_ps(a.xm[2 * row]), v);
        } else {
          const __m512i sa = _mm512_add_epi32(_mm512_set1_epi32(o0), _mm512_load_si512(sums[2 * j][i]));
          const __m512i sb = _mm512_add_epi32(_mm512_set1_epi32(o1), _mm512_load_si512(sums[2 * j + 1][i]));
          v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sa), _mm512_mul_ps(scale[j][0], dx), v);
          v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sb), _mm512_mul_ps(scale[j][1], dx), v);
          if constexpr (K::MIN) {
            v = _mm512_fmadd_ps(scale[j][2], _mm512_set1_ps(a.xm[2 * row]), v);
            v = _mm512_fmadd_ps(scale[j][3], _mm512_set1_ps(a.xm[2 * row + 1]), v);
          }
        }
      }
      _mm512_store_ps(acc[i], v);
    }
  }
  for (int64_t i = 0; i < rows; ++i) _mm512_mask_storeu_ps(y + (m0 + i) * N, mask, _mm512_load_ps(acc[i]));
}

}  // namespace kb
