// Quantized matmul on Intel AMX tiles: y[M, N] = x[M, K] · W[N, K]ᵀ for Q8_0 / Q4_0 weights (the layouts of
// quant_matmul.cpp), for batches of 16+ rows (decode batches, prefill chunks) on CPUs with AMX-BF16.
//
// The weights are dequantized to bf16 a block of 32 output rows at a time into a buffer that stays in L2,
// and multiplied there by the tile unit (TDPBF16PS: a 16×32 by 32×16 bf16 product into 16×16 fp32 per
// instruction). The previous path, dequantize the whole matrix to bf16 and call oneDNN's bf16 GEMM, wrote
// and re-read 2 bytes per weight through memory on every call — at a 64-row decode batch that round trip
// cost as much as the GEMM itself.
//
// The math is the bf16 GEMM path's: w = bf16(q · d) (bitwise quant_matmul.cpp's dequantize_bf16, torch's
// round-to-nearest-even), x rounded to bf16 the same way, products accumulated in fp32 (AMX flushes
// denormals; only the order of the additions differs from oneDNN's). Reference: forwardpass/quant/reference.py
// (``bf16_matmul``); tests/test_quant.py compares them.
//
// Tiles (A·B → C, C[i][j] += Σ_k A[i][k] · B[k][j] over bf16 pairs):
//   A = 16 weight rows × 32 K values, row-major from the dequantized buffer (no reshuffling of weights);
//   B = 32 K values × 16 activation rows in the "VNNI" pair layout: B[k/2][2j + k%2] = x[j][k], built once
//       per call (activations are few next to weights);
//   C = 16 weight rows × 16 activation rows, written transposed into y.
// Register use: C0..C3 (2 weight tiles × 2 activation tiles), A0, A1, B0, B1: all 8 tile registers; a batch of
// at most 16 rows uses one activation tile (C0, C2, A0, A1, B0).
//
// Not done, measured: fp32 weights through the same tiles, each fp32 operand split into three bf16 parts whose
// nine products sum to the fp32 product (the "bf16x9" emulation), ran at 57-109 fp32-GFLOP/s on this kind of
// machine's two cores vs 160-266 for oneDNN's fp32 GEMM: the tile unit here does ~3x fp32's rate, not 9x.
#include "torch_ext.h"  // forwardpass/csrc/: torch/extension.h less the C++ frontend
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "amx_state.h"
#include "block_weights.h"
#include "transpose16.h"  // forwardpass/csrc/

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t TM = 16;   // rows of a tile
constexpr int64_t NBLK = 32; // weight rows dequantized and multiplied together (two A tiles)
constexpr int64_t MBLK = 32; // activation rows per pass (two B tiles)

using amx::request_amx;
using amx::TileConfig;

// every tile 16 rows × 64 bytes (16 fp32 or 32 bf16 per row); loaded per thread (tile state is per thread)
void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = TM;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// 32 fp32 → 32 bf16 (lo first), round to nearest even: torch's rounding for every value these tiles see
// (the hardware conversion flushes denormals, as the tile unit does with its inputs anyway)
inline __m512i to_bf16(__m512 lo, __m512 hi) { return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)); }

// One block of 32 weights of one row → 32 bf16 at dst (w = q · d in fp32, then rounded).
template <bool Q4>
inline void dequant_block(const uint8_t* row, const at::Half* scales, int64_t b, uint16_t* dst) {
  __m512i lo, hi;  // weights 0..15 and 16..31 as int32
  if constexpr (Q4) {
    const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * QK / 2));
    const __m128i m = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    lo = _mm512_cvtepi8_epi32(_mm_sub_epi8(_mm_and_si128(t, m), eight));
    hi = _mm512_cvtepi8_epi32(_mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(t, 4), m), eight));
  } else {
    lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * QK)));
    hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * QK + 16)));
  }
  const __m512 d = _mm512_set1_ps(_cvtsh_ss(scales[b].x));
  _mm512_storeu_si512(dst, to_bf16(_mm512_mul_ps(_mm512_cvtepi32_ps(lo), d), _mm512_mul_ps(_mm512_cvtepi32_ps(hi), d)));
}

// x [M, K] fp32 → bf16 B tiles: tile (mt, kb) at xt + (mt·nb + kb)·512, row r = the pairs (x[j][2r], x[j][2r+1])
// of the block's activation rows j = 0..15. Rows past M and values past K are zero.
void prepare_activations(const float* x, int64_t M, int64_t K, int64_t nb, int64_t mtiles, uint16_t* xt) {
  at::parallel_for(0, mtiles, 1, [&](int64_t t0, int64_t t1) {
    alignas(64) uint16_t rowbuf[QK];
    for (int64_t mt = t0; mt < t1; ++mt) {
      for (int64_t kb = 0; kb < nb; ++kb) {
        uint32_t* tile = reinterpret_cast<uint32_t*>(xt + (mt * nb + kb) * TM * QK);
        for (int64_t j = 0; j < TM; ++j) {
          const int64_t m = mt * TM + j;
          const int64_t len = m < M ? std::min<int64_t>(QK, K - kb * QK) : 0;
          const __mmask16 m0 = len >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << len) - 1);
          const __mmask16 m1 = len <= 16 ? 0 : len >= 32 ? 0xFFFF : static_cast<__mmask16>((1u << (len - 16)) - 1);
          const float* src = x + (m < M ? m : 0) * K + kb * QK;
          _mm512_store_si512(rowbuf, to_bf16(_mm512_maskz_loadu_ps(m0, src), _mm512_maskz_loadu_ps(m1, src + 16)));
          const uint32_t* pairs = reinterpret_cast<const uint32_t*>(rowbuf);
          for (int64_t r = 0; r < TM; ++r) tile[r * TM + j] = pairs[r];
        }
      }
    }
  });
}

// C tile (16 weight rows n × 16 activation rows m, fp32, row-major) → y[m0 + m][n0 + n] for the rows and
// columns that exist, transposed in registers.
inline void store_transposed(const float* c, float* y, int64_t N, int64_t m0, int64_t n0, int64_t M) {
  const int64_t mm = std::min<int64_t>(TM, M - m0), nn = std::min<int64_t>(TM, N - n0);
  if (mm <= 0 || nn <= 0) return;
  __m512 r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(c + i * TM);
  transpose16(r);
  const __mmask16 cols = nn == TM ? 0xFFFF : static_cast<__mmask16>((1u << nn) - 1);
  for (int64_t m = 0; m < mm; ++m) _mm512_mask_storeu_ps(y + (m0 + m) * N + n0, cols, r[m]);
}

// 32 weight rows (a0, a_stride bytes between rows) × 32 activation rows (the tiles from b0 and b1, nb blocks each)
// → c[0..3] (weights 0-15 × activations 0-15, × 16-31; weights 16-31 × 0-15, × 16-31). With TWO_B false, a batch
// of at most 16 rows: only b0, c[0] and c[2] (a second B tile would be all padding: half the tile work wasted,
// measured 20% slower per 16-row decode step on 0.6B shapes).
template <bool TWO_B>
inline void block(const uint16_t* a0, int64_t a_stride, const uint16_t* b0, const uint16_t* b1, int64_t nb,
                  float c[4][TM * TM]) {
  const uint16_t* a1 = a0 + TM * (a_stride / 2);
  _tile_zero(0);
  _tile_zero(2);
  if constexpr (TWO_B) {
    _tile_zero(1);
    _tile_zero(3);
  }
  for (int64_t kb = 0; kb < nb; ++kb) {
    _tile_loadd(4, a0 + kb * QK, a_stride);
    _tile_loadd(5, a1 + kb * QK, a_stride);
    _tile_loadd(6, b0 + kb * TM * QK, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if constexpr (TWO_B) {
      _tile_loadd(7, b1 + kb * TM * QK, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c[0], 64);
  _tile_stored(2, c[2], 64);
  if constexpr (TWO_B) {
    _tile_stored(1, c[1], 64);
    _tile_stored(3, c[3], 64);
  }
}

template <bool Q4>
torch::Tensor amx_matmul(torch::Tensor x, torch::Tensor wq, torch::Tensor wd) {
  TORCH_CHECK(request_amx(), "the kernel may not use AMX tiles (arch_prctl refused)");
  const BlockMatmulShape shape = check_block_matmul<Q4>(x, wq, wd);  // QK (32) = K values per tile, too
  const int64_t M = shape.M, K = shape.K, N = shape.N, nb = shape.nb, w_stride = shape.w_stride;
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const int64_t Kp = nb * QK;
  const bool one_tile = M <= TM;  // a decode batch of up to 16 rows: one B tile
  const int64_t mgroups = one_tile ? 1 : (M + MBLK - 1) / MBLK, mtiles = one_tile ? 1 : mgroups * (MBLK / TM);
  auto xt = torch::empty({mtiles * nb * TM * QK}, x.options().dtype(torch::kBFloat16));
  uint16_t* xtp = reinterpret_cast<uint16_t*>(xt.data_ptr());
  prepare_activations(x.data_ptr<float>(), M, K, nb, mtiles, xtp);

  const uint8_t* wqp = reinterpret_cast<const uint8_t*>(wq.data_ptr());
  const at::Half* wdp = wd.data_ptr<at::Half>();
  float* yp = out.data_ptr<float>();
  const int64_t a_stride = Kp * 2;  // bytes between weight rows in the dequantized buffer
  // Each thread takes panels of weight rows: a panel is dequantized once into a buffer that stays in L2
  // (~256 KB), then every group of 32 activation rows runs over it, so the activations' tiles stay in L1/L2
  // and each output row is written in panel-wide pieces rather than 128-byte ones on a new page each time.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t fit = std::max<int64_t>(NBLK, (int64_t{256} * 1024 / a_stride) / NBLK * NBLK);
  const int64_t share = ((N + threads - 1) / threads + NBLK - 1) / NBLK * NBLK;
  const int64_t panel = std::min(fit, std::max(NBLK, share));
  at::parallel_for(0, (N + panel - 1) / panel, 1, [&](int64_t p0, int64_t p1) {
    configure_tiles();
    std::vector<uint16_t> wbuf(panel * Kp);  // this thread's dequantized weight rows (bf16)
    alignas(64) float c[4][TM * TM];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t pn0 = p * panel, rows = std::min(panel, N - pn0), blocks = (rows + NBLK - 1) / NBLK;
      for (int64_t r = 0; r < blocks * NBLK; ++r) {
        uint16_t* dst = wbuf.data() + r * Kp;
        if (r >= rows) {
          std::memset(dst, 0, Kp * sizeof(uint16_t));
          continue;
        }
        const uint8_t* row = wqp + (pn0 + r) * w_stride;
        const at::Half* scales = wdp + (pn0 + r) * nb;
        for (int64_t b = 0; b < nb; ++b) dequant_block<Q4>(row, scales, b, dst + b * QK);
      }
      for (int64_t g = 0; g < mgroups; ++g) {
        const uint16_t* b0 = xtp + (2 * g) * nb * TM * QK;
        const uint16_t* b1 = b0 + nb * TM * QK;
        const int64_t m0 = g * MBLK;
        for (int64_t blk = 0; blk < blocks; ++blk) {
          const uint16_t* a0 = wbuf.data() + blk * NBLK * Kp;
          const int64_t n0 = pn0 + blk * NBLK;
          if (one_tile) {
            block<false>(a0, a_stride, b0, b1, nb, c);
          } else {
            block<true>(a0, a_stride, b0, b1, nb, c);
            store_transposed(c[1], yp, N, m0 + TM, n0, M);
            store_transposed(c[3], yp, N, m0 + TM, n0 + TM, M);
          }
          store_transposed(c[0], yp, N, m0, n0, M);
          store_transposed(c[2], yp, N, m0, n0 + TM, M);
        }
      }
    }
    _tile_release();
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &request_amx, "whether this process may use AMX tiles (asks Linux once)");
  m.def("q8_0_matmul", &amx_matmul<false>, "x[M,K] fp32 · Q8_0 W[N,K]ᵀ in bf16 on AMX tiles, fp32 out");
  m.def("q4_0_matmul", &amx_matmul<true>, "x[M,K] fp32 · Q4_0 W[N,K]ᵀ in bf16 on AMX tiles, fp32 out");
}
