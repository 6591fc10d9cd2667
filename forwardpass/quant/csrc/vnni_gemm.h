// Quantized GEMM for many activation rows on AVX-512 VNNI CPUs without AMX (AMD Zen 4 and later, Intel Ice
// Lake / Cascade Lake): prefill chunks and large decode batches. Included by quant_matmul.cpp in its VNNI build.
//
// The GGUF layout's matvec kernel holds K in the vector lanes: every 64 multiply-adds (one vpdpbusd) are followed
// by a convert, a scale and an FMA. Here the lanes hold 16 OUTPUT COLUMNS instead, as a GEMM does: W is stored in
// the tile layout (tiles.h), in which each 64-byte group holds 4 consecutive k of 16 weight rows; a panel of 32
// weight rows is copied once per call into vpdpbusd's operand form ([block][k/4][2 vectors][16 rows][4 bytes],
// unsigned), kept in L1/L2, and each activation row's 4 bytes at k are broadcast against it. A block of 32 k is
// then 8 vpdpbusd per (activation row, 16 columns) into an int32 accumulator, and only then one convert, scale
// and FMA: ~3x fewer instructions per multiply-add.
//
// Same math as the matvec kernels: the activations are quantized per block of 32 by quantize_row (the same bytes),
// the block sums are exact int32, each is scaled by the float32 product d_w · d_x and added in float32, blocks in
// sequence — the order of the tile layout's small-batch kernel (tiles.h), so the two agree bit for bit and a
// sequence's result does not depend on the batch it decodes in; the GGUF layout's kernel pairs blocks (to float
// rounding). Unsigned weights as in the matvec kernel: Q8_0's w ^ 0x80 = w + 128, Q4_0's nibbles q = w + 8; each int32
// accumulator starts at -offset · Σ(the activation row's block), which cancels the offset exactly.
#pragma once

#include "tiles.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

namespace vnni_gemm {

constexpr int64_t NV = 2;        // 16-column vectors per panel
constexpr int64_t NP = 16 * NV;  // weight rows (output columns) per panel
constexpr int64_t MR = 4;        // activation rows per register block: 4 x 2 int32 + 4 x 2 float accumulators
constexpr int64_t MC = 256;      // activation rows per pass over the weights (their int8 copy stays in L2)

// Weight rows n0..n0+NP (rows >= N are zeros with scale 0) → pw [nb][8][NV][16] dwords and ps [nb][NV][16]
// floats (the fp16 scales, converted). The tile layout's 4-byte groups are already these dwords, less the offset
// that makes them unsigned (Q8_0: w ^ 0x80 = w + 128; Q4_0: one nibble of each byte, q = w + 8).
template <bool Q4>
void repack_panel(const uint8_t* wq, int64_t w_stride, const at::Half* wd, int64_t nb, int64_t n0, int64_t N,
                  uint32_t* pw, float* ps) {
  for (int64_t v = 0; v < NV; ++v) {  // one 64-byte group of a tile → one vector (masked past the tile's rows)
    const int64_t t = n0 / 16 + v;
    const tiles::Tile tile = 16 * t < N ? tiles::tile_of(t, N, w_stride, nb) : tiles::Tile{0, 0, 0};
    const __mmask16 mask = tiles::lanes(tile.rows);
    const uint8_t* tw = wq + tile.w_offset;
    for (int64_t b = 0; b < nb; ++b) {
      for (int64_t q = 0; q < 8; ++q) {
        const __m512i g = _mm512_maskz_loadu_epi32(mask, tw + tiles::group_offset<Q4>(b, Q4 ? q / 2 : q, tile.rows, 0));
        const __m512i u = Q4 ? _mm512_and_si512(_mm512_srli_epi16(g, 4 * (q % 2)), _mm512_set1_epi8(0x0F))
                             : _mm512_xor_si512(g, _mm512_set1_epi8(static_cast<char>(0x80)));
        _mm512_store_si512(pw + ((b * 8 + q) * NV + v) * 16, _mm512_maskz_mov_epi32(mask, u));
      }
      _mm512_store_ps(ps + (b * NV + v) * 16,
                      _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, wd + tile.d_offset + b * tile.rows)));
    }
  }
}

// Activation rows m..m+R against the panel: y[m + i][n0 + 16v + lane] for the first `cols` columns.
// xq [M, nb·32] int8, xd [M, nb] scales, xc [M, nb] the int32 starting values -offset · Σ block.
template <int R>
inline void block(const uint32_t* pw, const float* ps, int64_t nb, const int8_t* xq, const float* xd,
                  const int32_t* xc, int64_t m, float* y, int64_t N, int64_t n0, int64_t cols) {
  __m512 acc[R][NV];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i sum[R][NV];
    for (int i = 0; i < R; ++i) {
      const __m512i start = _mm512_set1_epi32(xc[(m + i) * nb + b]);
      for (int v = 0; v < NV; ++v) sum[i][v] = start;
    }
    const uint32_t* pb = pw + b * 8 * NV * 16;
    const int8_t* xb = xq + m * nb * QK + b * QK;
#pragma GCC unroll 8
    for (int q = 0; q < 8; ++q) {
      __m512i w[NV];
      for (int v = 0; v < NV; ++v) w[v] = _mm512_load_si512(pb + (q * NV + v) * 16);
      for (int i = 0; i < R; ++i) {
        int32_t xw;
        std::memcpy(&xw, xb + i * nb * QK + 4 * q, 4);
        const __m512i xv = _mm512_set1_epi32(xw);
        for (int v = 0; v < NV; ++v) sum[i][v] = _mm512_dpbusd_epi32(sum[i][v], w[v], xv);
      }
    }
    for (int v = 0; v < NV; ++v) {
      const __m512 dw = _mm512_load_ps(ps + (b * NV + v) * 16);
      for (int i = 0; i < R; ++i)  // the float32 product d_w · d_x, then one FMA, as the matvec kernel
        acc[i][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i][v]),
                                    _mm512_mul_ps(dw, _mm512_set1_ps(xd[(m + i) * nb + b])), acc[i][v]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < NV; ++v) {
      const int64_t c = std::min<int64_t>(16, cols - 16 * v);
      if (c <= 0) continue;
      _mm512_mask_storeu_ps(y + (m + i) * N + n0 + 16 * v, static_cast<__mmask16>((1u << c) - 1), acc[i][v]);
    }
}

// y [M, N] = x · Wᵀ, W in the tile layout, x already quantized (xq, xd) with its starting values xc.
template <bool Q4>
void gemm(const int8_t* xq, const float* xd, const int32_t* xc, int64_t M, const uint8_t* wq, int64_t w_stride,
          const at::Half* wd, int64_t nb, int64_t N, float* y) {
  const int64_t panels = (N + NP - 1) / NP;
  for (int64_t m0 = 0; m0 < M; m0 += MC) {
    const int64_t m1 = std::min(M, m0 + MC);
    at::parallel_for(0, panels, 1, [&](int64_t p_begin, int64_t p_end) {
      auto pw = std::unique_ptr<uint32_t[], decltype(&std::free)>(
          static_cast<uint32_t*>(std::aligned_alloc(64, nb * 8 * NV * 16 * sizeof(uint32_t))), &std::free);
      auto ps = std::unique_ptr<float[], decltype(&std::free)>(
          static_cast<float*>(std::aligned_alloc(64, nb * NV * 16 * sizeof(float))), &std::free);
      TORCH_CHECK(pw && ps, "out of memory for a weight panel");
      for (int64_t p = p_begin; p < p_end; ++p) {
        const int64_t n0 = p * NP, cols = std::min(NP, N - n0);
        repack_panel<Q4>(wq, w_stride, wd, nb, n0, N, pw.get(), ps.get());
        int64_t m = m0;
        for (; m + MR <= m1; m += MR) block<MR>(pw.get(), ps.get(), nb, xq, xd, xc, m, y, N, n0, cols);
        switch (m1 - m) {
          case 3: block<3>(pw.get(), ps.get(), nb, xq, xd, xc, m, y, N, n0, cols); break;
          case 2: block<2>(pw.get(), ps.get(), nb, xq, xd, xc, m, y, N, n0, cols); break;
          case 1: block<1>(pw.get(), ps.get(), nb, xq, xd, xc, m, y, N, n0, cols); break;
          default: break;
        }
      }
    });
  }
}

}  // namespace vnni_gemm
