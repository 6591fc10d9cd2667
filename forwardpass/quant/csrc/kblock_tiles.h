// The K-block kernel's inner loop: one tile of 16 weight rows (kblocks.py::pack's layout) against MR activation
// rows, in each build's vectors. kblock_matmul.cpp hands the tiles out over the threads.
//
// Why tiles: in a row layout a vector holds 32-64 consecutive weights of ONE row, so every dot product is followed
// by a horizontal reduction, a scale broadcast and an FMA, and the row's lanes are summed at the end (the old
// kernel ran at half the Q4_0 kernel's rate). In the tile layout one 4-byte field per row, 16 rows side by side,
// is one vector load: each int32 lane is one OUTPUT row, the lanes sum a group of 16 weights in 4 dot products
// (the activations' 4 bytes broadcast), and a group's scales are a vector load of the 16 rows' scale fields:
// one convert and one FMA per group, no reduction at all (as the Q8_0/Q4_0 tile kernels, tiles.h).
//
// Per block of 32 weights (elements 8g + c low nibble of group g, 8g + 4 + c high; 5-bit codes add their bit 4
// from one plane, 6-bit codes their high 2 bits from two), with x the int8 activations and dx their scale:
//   acc += float(Σ_{0..15} u·x - OFF·Σ x) · (d·sc₀·dx) + float(Σ_{16..31} ...) · (d·sc₁·dx)   (one sum for G = 32)
//   acc += min · (dx · Σ x)   per group, types with mins (Q4_1, Q5_1: +m; K-quants: -dmin·mc)
// -OFF·Σx is exact in int32 and starts the integer sums (computed once per activation row).
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace kb {

constexpr int64_t TILE = 16;

// A type's layout: BITS 4, 5, 6 or 8 (8: Q8_0's bytes, offset 128), SB blocks of 32 per d (1 or 8), G weights per
// scale (16 or 32), mins, code offset.
template <int BITS_, int SB_, int G_, bool MIN_, int OFF_>
struct Kind {
  static constexpr int BITS = BITS_, SB = SB_, G = G_, OFF = OFF_;
  static constexpr bool MIN = MIN_;
  static constexpr int BB = BITS == 8 ? 32 : BITS == 6 ? 24 : BITS == 5 ? 20 : 16;  // code bytes per block of 32
  static constexpr int GPB = 32 / G;                                                // groups per block
  // Q4_K / Q5_K: their 6-bit scale and min factors packed as the file packs them, 12 bytes per super-block
  static constexpr bool PACK6 = SB > 1 && MIN && G == 32;
  // meta bytes of a row of nb blocks (kblocks.py::meta_bytes)
  static int64_t meta_bytes(int64_t nb) {
    const int64_t nd = nb / SB;
    int64_t bytes = nd * 2 * (MIN ? 2 : 1);
    if (PACK6)
      bytes += nb + nd * 4;
    else if (SB > 1)
      bytes += nb * GPB * (MIN ? 2 : 1);
    return (bytes + 3) / 4 * 4;
  }
};

// the meta fields of a tile of R rows: d[s][r], dm[s][r] (fp16), sc[j][r], mc[j][r] (int8); PACK6 kinds have
// instead lo[j][r] (the low 4 bits of scale j, then of min j) and hi[s][r], a uint32 whose bits 4i, 4i + 1 are the
// high 2 bits of the scale of the super-block's group i, bits 4i + 2, 4i + 3 those of its min
template <class K>
struct TileMeta {
  const uint16_t* d;
  const uint16_t* dm;
  const int8_t* sc;
  const int8_t* mc;
  const uint8_t* lo;
  const uint8_t* hi;
  TileMeta(const uint8_t* m, int64_t R, int64_t nb) {
    const int64_t nd = nb / K::SB;
    d = reinterpret_cast<const uint16_t*>(m);
    dm = d + nd * R;
    sc = reinterpret_cast<const int8_t*>(m + nd * R * 2 * (K::MIN ? 2 : 1));
    mc = sc + nb * K::GPB * R;
    lo = reinterpret_cast<const uint8_t*>(sc);
    hi = lo + nb * R;
  }
  // PACK6: the scale and min factor of group (block) b of row r
  void factors(int64_t b, int64_t R, int64_t r, int* s, int* mn) const {
    uint32_t h;
    std::memcpy(&h, hi + (b / K::SB * R + r) * 4, 4);
    h >>= 4 * (b % K::SB);
    *s = (lo[b * R + r] & 0x0F) | ((h & 3) << 4);
    *mn = (lo[b * R + r] >> 4) | (((h >> 2) & 3) << 4);
  }
};

// The activations, prepared once per matmul (kblock_matmul.cpp::prepare)
struct Acts {
  const int8_t* xq;   // [M, nb·32]
  const float* xd;    // [M, nb]
  const int32_t* xo;  // [M, nb·2]: -OFF · Σ x of each half block (types with a code offset)
  const float* xm;    // [M, nb·2]: dx · Σ x of each group (G = 32: the block's, then unused)
  int64_t nb;
};

inline int32_t bytes4(const int8_t* p) {  // 4 activation bytes as one int32 (memcpy: no aliasing breach)
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// ---- AVX-512 VNNI: one zmm = 16 rows; vpdpbusd sums 4 unsigned code × signed activation products per lane ----

// Block b of a tile, unpacked (shared by tile_dot and the AMX path, kblock_amx.h): lo[g] holds elements 8g..8g+3
// of the 16 rows' codes, hi[g] elements 8g+4..8g+7 (one 4-byte field per lane); s0 / s1 the scales (d·sc) of the
// block's groups, n0 / n1 their min factors. dv, dmv, hw carry over from block to block within a super-block.
struct Block512 {
  __m512i lo[4], hi[4];
  __m512 s0, s1, n0, n1;
  __m512 dv = _mm512_setzero_ps(), dmv = _mm512_setzero_ps();
  __m512i hw = _mm512_setzero_si512();  // PACK6: the super-block's high bits, shifted down a group at a time
};

template <class K>
__attribute__((always_inline)) inline void unpack_block(const uint8_t* tc, const TileMeta<K>& meta, int64_t R,
                                                        __mmask16 mask, int64_t b, Block512& f) {
  const int64_t gs = R * 4;
  const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
  __m512i(&lo)[4] = f.lo;
  __m512i(&hi)[4] = f.hi;
  __m512 &dv = f.dv, &dmv = f.dmv, &s0 = f.s0, &s1 = f.s1, &n0 = f.n0, &n1 = f.n1;
  __m512i& hw = f.hw;
  const uint8_t* p = tc + b * K::BB * R;
  if (b % K::SB == 0) {
    dv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, meta.d + b / K::SB * R));
    if constexpr (K::MIN) {
      dmv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, meta.dm + b / K::SB * R));
      if constexpr (K::SB > 1) dmv = _mm512_sub_ps(_mm512_setzero_ps(), dmv);  // K-quants subtract mins
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < 4; ++g) {
    if constexpr (K::BITS == 8) {  // the codes as they are: field 2g is lo[g], 2g + 1 hi[g]
      lo[g] = _mm512_maskz_loadu_epi32(mask, p + 2 * g * gs);
      hi[g] = _mm512_maskz_loadu_epi32(mask, p + (2 * g + 1) * gs);
    } else {
      const __m512i v = _mm512_maskz_loadu_epi32(mask, p + g * gs);
      lo[g] = _mm512_and_si512(v, low);
      hi[g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
  }
  if constexpr (K::BITS == 5) {  // byte c, bit j: bit 4 of byte c of vector j (lo[g] is vector 2g, hi[g] 2g + 1)
    // shifted so that bit j lands on bit 4 (left by 4 - j, right by j - 4: a 16-bit shift of at most 4 keeps
    // each byte's bit 4 from its own byte), then or-ed in under the mask (ternary logic: a | (b & c))
    const __m512i h = _mm512_maskz_loadu_epi32(mask, p + 16 * R), b4 = _mm512_set1_epi8(0x10);
    auto put = [&](__m512i& v, __m512i bits) { v = _mm512_ternarylogic_epi32(v, bits, b4, 0xF8); };
    put(lo[0], _mm512_slli_epi16(h, 4));
    put(hi[0], _mm512_slli_epi16(h, 3));
    put(lo[1], _mm512_slli_epi16(h, 2));
    put(hi[1], _mm512_slli_epi16(h, 1));
    put(lo[2], h);
    put(hi[2], _mm512_srli_epi16(h, 1));
    put(lo[3], _mm512_srli_epi16(h, 2));
    put(hi[3], _mm512_srli_epi16(h, 3));
  }
  if constexpr (K::BITS == 6) {  // plane q: bits 0-1 → lo[2q], 2-3 → hi[2q], 4-5 → lo[2q+1], 6-7 → hi[2q+1]
#pragma GCC unroll 2
    for (int q = 0; q < 2; ++q) {
      const __m512i h = _mm512_maskz_loadu_epi32(mask, p + 16 * R + q * gs);
      lo[2 * q] = _mm512_or_si512(lo[2 * q], _mm512_and_si512(_mm512_slli_epi16(h, 4), top));
      hi[2 * q] = _mm512_or_si512(hi[2 * q], _mm512_and_si512(_mm512_slli_epi16(h, 2), top));
      lo[2 * q + 1] = _mm512_or_si512(lo[2 * q + 1], _mm512_and_si512(h, top));
      hi[2 * q + 1] = _mm512_or_si512(hi[2 * q + 1], _mm512_and_si512(_mm512_srli_epi16(h, 2), top));
    }
  }
  s0 = dv, s1 = dv, n0 = dmv, n1 = dmv;
  if constexpr (K::PACK6) {  // one group per block: 4 low bits of each factor, then 2 high bits from hw
    if (b % K::SB == 0) hw = _mm512_maskz_loadu_epi32(mask, meta.hi + b / K::SB * R * 4);
    const __m512i l = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, meta.lo + b * R));
    const __m512i m4 = _mm512_set1_epi32(0x0F), m30 = _mm512_set1_epi32(0x30);
    const __m512i sc = _mm512_ternarylogic_epi32(_mm512_and_si512(l, m4), _mm512_slli_epi32(hw, 4), m30, 0xF8);
    const __m512i mc = _mm512_ternarylogic_epi32(_mm512_srli_epi32(l, 4), _mm512_slli_epi32(hw, 2), m30, 0xF8);
    hw = _mm512_srli_epi32(hw, 4);
    s0 = s1 = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(sc));
    n0 = n1 = _mm512_mul_ps(dmv, _mm512_cvtepi32_ps(mc));
  } else if constexpr (K::SB > 1) {
    auto factor = [&](const int8_t* f, int h) {
      return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, f + (b * K::GPB + h) * R)));
    };
    s0 = _mm512_mul_ps(dv, factor(meta.sc, 0));
    s1 = K::GPB == 2 ? _mm512_mul_ps(dv, factor(meta.sc, 1)) : s0;
    if constexpr (K::MIN) {
      n0 = _mm512_mul_ps(dmv, factor(meta.mc, 0));
      n1 = K::GPB == 2 ? _mm512_mul_ps(dmv, factor(meta.mc, 1)) : n0;
    }
  }
}

template <class K, int MR>
inline void tile_dot(const uint8_t* tc, const uint8_t* tm, int64_t R, const Acts& a, int64_t m0, float* y,
                     int64_t N) {
  const int64_t nb = a.nb;
  const __mmask16 mask = static_cast<__mmask16>((1u << R) - 1);
  const TileMeta<K> meta(tm, R, nb);
  __m512 acc[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  Block512 f;
  for (int64_t b = 0; b < nb; ++b) {
    unpack_block<K>(tc, meta, R, mask, b, f);
    const __m512i(&lo)[4] = f.lo;
    const __m512i(&hi)[4] = f.hi;
    const __m512 s0 = f.s0, s1 = f.s1, n0 = f.n0, n1 = f.n1;
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const int64_t row = (m0 + i) * nb + b;
      const int8_t* xb = a.xq + row * 32;
      __m512i sa = K::OFF ? _mm512_set1_epi32(a.xo[2 * row]) : _mm512_setzero_si512();
      __m512i sb = K::OFF ? _mm512_set1_epi32(a.xo[2 * row + 1]) : _mm512_setzero_si512();
      sa = _mm512_dpbusd_epi32(sa, lo[0], _mm512_set1_epi32(bytes4(xb)));
      sb = _mm512_dpbusd_epi32(sb, lo[2], _mm512_set1_epi32(bytes4(xb + 16)));
      sa = _mm512_dpbusd_epi32(sa, hi[0], _mm512_set1_epi32(bytes4(xb + 4)));
      sb = _mm512_dpbusd_epi32(sb, hi[2], _mm512_set1_epi32(bytes4(xb + 20)));
      sa = _mm512_dpbusd_epi32(sa, lo[1], _mm512_set1_epi32(bytes4(xb + 8)));
      sb = _mm512_dpbusd_epi32(sb, lo[3], _mm512_set1_epi32(bytes4(xb + 24)));
      sa = _mm512_dpbusd_epi32(sa, hi[1], _mm512_set1_epi32(bytes4(xb + 12)));
      sb = _mm512_dpbusd_epi32(sb, hi[3], _mm512_set1_epi32(bytes4(xb + 28)));
      const __m512 dx = _mm512_set1_ps(a.xd[row]);
      if constexpr (K::GPB == 1) {
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(sa, sb)), _mm512_mul_ps(s0, dx), acc[i]);
        if constexpr (K::MIN) acc[i] = _mm512_fmadd_ps(n0, _mm512_set1_ps(a.xm[2 * row]), acc[i]);
      } else {
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sa), _mm512_mul_ps(s0, dx), acc[i]);
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sb), _mm512_mul_ps(s1, dx), acc[i]);
        if constexpr (K::MIN) {
          acc[i] = _mm512_fmadd_ps(n0, _mm512_set1_ps(a.xm[2 * row]), acc[i]);
          acc[i] = _mm512_fmadd_ps(n1, _mm512_set1_ps(a.xm[2 * row + 1]), acc[i]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) _mm512_mask_storeu_ps(y + (m0 + i) * N, mask, acc[i]);
}
constexpr int MAX_MR = 8;  // 8 accumulators + the block's 8 code and 4 scale vectors fit the 32 zmm
#else
// ---- AVX2: 16 rows as two ymm halves of 8; maddubs + madd for 4 products per lane ----
#define KB_AVX2 1  // kblock_gemm_avx2.h builds on this section
// n fields of 4 bytes (n < 8 only in a matrix's last tile: copied, never read past the tensor)
inline __m256i load_fields(const void* p, int64_t n) {
  if (n == 8) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  alignas(32) int32_t buf[8] = {};
  std::memcpy(buf, p, n * 4);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(buf));
}
inline __m256 load_halves(const uint16_t* p, int64_t n) {  // n fp16 → fp32
  if (n == 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  uint16_t buf[8] = {};
  std::memcpy(buf, p, n * 2);
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(buf)));
}
inline __m128i load_bytes8(const void* p, int64_t n) {  // n <= 8 bytes, the rest zero
  int64_t v = 0;
  std::memcpy(&v, p, n == 8 ? 8 : n);
  return _mm_cvtsi64_si128(v);
}
inline __m256 load_factors(const int8_t* p, int64_t n) {  // n int8 → fp32
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load_bytes8(p, n)));
}

// Block b of rows h0 .. h0 + n of a tile (one ymm half, n <= 8 rows), unpacked (shared by tile_dot and the GEMM
// mode, kblock_gemm_avx2.h): lo[g] holds elements 8g..8g+3 of the rows' codes, hi[g] elements 8g+4..8g+7, one
// 4-byte field per lane; s0 / s1 the scales of the block's groups, n0 / n1 their min factors. dv, dmv, hw carry
// over from block to block within a super-block. (Separate arrays and scalars, not a struct: with a struct GCC
// kept the codes in memory and the one- and two-row decode loop ran ~15% slower.)
template <class K>
__attribute__((always_inline)) inline void unpack_half(const uint8_t* tc, const TileMeta<K>& meta, int64_t R,
                                                       int64_t h0, int64_t n, int64_t b, __m256i (&lo)[4],
                                                       __m256i (&hi)[4], __m256& s0, __m256& s1, __m256& n0,
                                                       __m256& n1, __m256& dv, __m256& dmv, __m256i& hw,
                                                       const __m256i low, const __m256i top) {
  const int64_t gs = R * 4;
  const uint8_t* p = tc + b * K::BB * R + h0 * 4;
  if (b % K::SB == 0) {
    dv = load_halves(meta.d + b / K::SB * R + h0, n);
    if constexpr (K::MIN) {
      dmv = load_halves(meta.dm + b / K::SB * R + h0, n);
      if constexpr (K::SB > 1) dmv = _mm256_sub_ps(_mm256_setzero_ps(), dmv);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < 4; ++g) {
    if constexpr (K::BITS == 8) {
      lo[g] = load_fields(p + 2 * g * gs, n);
      hi[g] = load_fields(p + (2 * g + 1) * gs, n);
    } else {
      const __m256i v = load_fields(p + g * gs, n);
      lo[g] = _mm256_and_si256(v, low);
      hi[g] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
  }
  if constexpr (K::BITS == 5) {  // as in the AVX-512 build: bit j of each byte to bit 4 of vector j
    const __m256i h = load_fields(p + 16 * R, n), b4 = _mm256_set1_epi8(0x10);
    auto put = [&](__m256i& v, __m256i bits) { v = _mm256_or_si256(v, _mm256_and_si256(bits, b4)); };
    put(lo[0], _mm256_slli_epi16(h, 4));
    put(hi[0], _mm256_slli_epi16(h, 3));
    put(lo[1], _mm256_slli_epi16(h, 2));
    put(hi[1], _mm256_slli_epi16(h, 1));
    put(lo[2], h);
    put(hi[2], _mm256_srli_epi16(h, 1));
    put(lo[3], _mm256_srli_epi16(h, 2));
    put(hi[3], _mm256_srli_epi16(h, 3));
  }
  if constexpr (K::BITS == 6) {
#pragma GCC unroll 2
    for (int q = 0; q < 2; ++q) {
      const __m256i h = load_fields(p + 16 * R + q * gs, n);
      lo[2 * q] = _mm256_or_si256(lo[2 * q], _mm256_and_si256(_mm256_slli_epi16(h, 4), top));
      hi[2 * q] = _mm256_or_si256(hi[2 * q], _mm256_and_si256(_mm256_slli_epi16(h, 2), top));
      lo[2 * q + 1] = _mm256_or_si256(lo[2 * q + 1], _mm256_and_si256(h, top));
      hi[2 * q + 1] = _mm256_or_si256(hi[2 * q + 1], _mm256_and_si256(_mm256_srli_epi16(h, 2), top));
    }
  }
  s0 = dv, s1 = dv, n0 = dmv, n1 = dmv;
  if constexpr (K::PACK6) {  // as in the AVX-512 build
    if (b % K::SB == 0) hw = load_fields(meta.hi + (b / K::SB * R + h0) * 4, n);
    const __m256i l = _mm256_cvtepu8_epi32(load_bytes8(meta.lo + b * R + h0, n));
    const __m256i m4 = _mm256_set1_epi32(0x0F), m30 = _mm256_set1_epi32(0x30);
    const __m256i sc = _mm256_or_si256(_mm256_and_si256(l, m4), _mm256_and_si256(_mm256_slli_epi32(hw, 4), m30));
    const __m256i mc = _mm256_or_si256(_mm256_srli_epi32(l, 4), _mm256_and_si256(_mm256_slli_epi32(hw, 2), m30));
    hw = _mm256_srli_epi32(hw, 4);
    s0 = s1 = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(sc));
    n0 = n1 = _mm256_mul_ps(dmv, _mm256_cvtepi32_ps(mc));
  } else if constexpr (K::SB > 1) {
    const int64_t j = b * K::GPB * R + h0;
    s0 = _mm256_mul_ps(dv, load_factors(meta.sc + j, n));
    s1 = K::GPB == 2 ? _mm256_mul_ps(dv, load_factors(meta.sc + j + R, n)) : s0;
    if constexpr (K::MIN) {
      n0 = _mm256_mul_ps(dmv, load_factors(meta.mc + j, n));
      n1 = K::GPB == 2 ? _mm256_mul_ps(dmv, load_factors(meta.mc + j + R, n)) : n0;
    }
  }
}

// The float step of one activation row after a block's integer sums (sa: the first group or, G = 32, the whole
// block; sb: the second group), in the order every path keeps (the results are bitwise the same whatever
// computes the sums): one convert and FMA per group with (d·sc)·dx, then the mins.
template <class K>
__attribute__((always_inline)) inline __m256 block_step(__m256 acc, __m256i sa, __m256i sb, __m256 s0, __m256 s1, __m256 n0, __m256 n1,
                         const Acts& a, int64_t row) {
  const __m256 dx = _mm256_set1_ps(a.xd[row]);
  if constexpr (K::GPB == 1) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(sa, sb)), _mm256_mul_ps(s0, dx), acc);
    if constexpr (K::MIN) acc = _mm256_fmadd_ps(n0, _mm256_set1_ps(a.xm[2 * row]), acc);
  } else {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sa), _mm256_mul_ps(s0, dx), acc);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sb), _mm256_mul_ps(s1, dx), acc);
    if constexpr (K::MIN) {
      acc = _mm256_fmadd_ps(n0, _mm256_set1_ps(a.xm[2 * row]), acc);
      acc = _mm256_fmadd_ps(n1, _mm256_set1_ps(a.xm[2 * row + 1]), acc);
    }
  }
  return acc;
}

inline void store_rows(float* out, __m256 v, int64_t n) {  // n <= 8 outputs
  if (n == 8) {
    _mm256_storeu_ps(out, v);
    return;
  }
  alignas(32) float buf[8];
  _mm256_store_ps(buf, v);
  std::memcpy(out, buf, n * sizeof(float));
}

template <class K, int MR>
inline void tile_dot(const uint8_t* tc, const uint8_t* tm, int64_t R, const Acts& a, int64_t m0, float* y,
                     int64_t N) {
  const int64_t nb = a.nb;
  const TileMeta<K> meta(tm, R, nb);
  const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30), ones = _mm256_set1_epi16(1);
  for (int64_t h0 = 0; h0 < R; h0 += 8) {  // rows h0 .. h0 + n of the tile
    const int64_t n = std::min<int64_t>(8, R - h0);
    __m256 acc[MR];
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
    __m256 dv = _mm256_setzero_ps(), dmv = _mm256_setzero_ps();
    __m256i hw = _mm256_setzero_si256();
    for (int64_t b = 0; b < nb; ++b) {
      __m256i lo[4], hi[4];
      __m256 s0, s1, n0, n1;
      unpack_half<K>(tc, meta, R, h0, n, b, lo, hi, s0, s1, n0, n1, dv, dmv, hw, low, top);
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) {
        const int64_t row = (m0 + i) * nb + b;
        const int8_t* xb = a.xq + row * 32;
        auto prod = [&](__m256i u, int k) { return _mm256_maddubs_epi16(u, _mm256_set1_epi32(bytes4(xb + k))); };
        // int16 sums stay exact: |u·x + u·x| <= 2·31·127 (4- and 5-bit codes: 4 of them add up to 31496) or
        // 2·63·127 (6-bit: 2 of them, 32004)
        __m256i sa, sb;
        if constexpr (K::BITS == 8) {
          // u - 128 = q (the sign bit flipped); maddubs(|q|, sign(x, q)) = q·x pairs <= 2·128·127: exact in
          // int16, one madd each (no code offset to add: the products are signed already)
          auto prod8 = [&](__m256i u, int k) {
            const __m256i q = _mm256_xor_si256(u, _mm256_set1_epi8(static_cast<char>(0x80)));
            const __m256i x = _mm256_set1_epi32(bytes4(xb + k));
            return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(x, q)), ones);
          };
          sa = _mm256_add_epi32(_mm256_add_epi32(prod8(lo[0], 0), prod8(hi[0], 4)),
                                _mm256_add_epi32(prod8(lo[1], 8), prod8(hi[1], 12)));
          sb = _mm256_add_epi32(_mm256_add_epi32(prod8(lo[2], 16), prod8(hi[2], 20)),
                                _mm256_add_epi32(prod8(lo[3], 24), prod8(hi[3], 28)));
        } else if constexpr (K::BITS <= 5) {
          sa = _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(prod(lo[0], 0), prod(hi[0], 4)),
                                                  _mm256_add_epi16(prod(lo[1], 8), prod(hi[1], 12))), ones);
          sb = _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(prod(lo[2], 16), prod(hi[2], 20)),
                                                  _mm256_add_epi16(prod(lo[3], 24), prod(hi[3], 28))), ones);
        } else {
          sa = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(prod(lo[0], 0), prod(hi[0], 4)), ones),
                                _mm256_madd_epi16(_mm256_add_epi16(prod(lo[1], 8), prod(hi[1], 12)), ones));
          sb = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(prod(lo[2], 16), prod(hi[2], 20)), ones),
                                _mm256_madd_epi16(_mm256_add_epi16(prod(lo[3], 24), prod(hi[3], 28)), ones));
        }
        if constexpr (K::OFF != 0 && K::BITS != 8) {
          sa = _mm256_add_epi32(sa, _mm256_set1_epi32(a.xo[2 * row]));
          sb = _mm256_add_epi32(sb, _mm256_set1_epi32(a.xo[2 * row + 1]));
        }
        const __m256 dx = _mm256_set1_ps(a.xd[row]);
        if constexpr (K::GPB == 1) {
          acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(sa, sb)), _mm256_mul_ps(s0, dx), acc[i]);
          if constexpr (K::MIN) acc[i] = _mm256_fmadd_ps(n0, _mm256_set1_ps(a.xm[2 * row]), acc[i]);
        } else {
          acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sa), _mm256_mul_ps(s0, dx), acc[i]);
          acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sb), _mm256_mul_ps(s1, dx), acc[i]);
          if constexpr (K::MIN) {
            acc[i] = _mm256_fmadd_ps(n0, _mm256_set1_ps(a.xm[2 * row]), acc[i]);
            acc[i] = _mm256_fmadd_ps(n1, _mm256_set1_ps(a.xm[2 * row + 1]), acc[i]);
          }
        }
      }
    }
    for (int i = 0; i < MR; ++i) {
      alignas(32) float buf[8];
      _mm256_store_ps(buf, acc[i]);
      std::memcpy(y + (m0 + i) * N + h0, buf, n * sizeof(float));
    }
  }
}
constexpr int MAX_MR = 2;
#endif

}  // namespace kb
