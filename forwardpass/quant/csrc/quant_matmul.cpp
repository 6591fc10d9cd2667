// Weight-only quantized matmul for AVX2/FMA CPUs: y[M, N] = x[M, K] · W[N, K]ᵀ with W stored in blocks of
// 32 weights along K, one fp16 scale per block (Q8_0: int8 values; Q4_0: 4-bit values q, weight = (q - 8) · d,
// the GGUF layouts, so a llama.cpp file's tensors are used as they are). The engine's weights are reordered into
// the tile layout (tile_layout.h), whose kernels (tiles.h, tiles_avx2.h, vnni_gemm.h) are faster; the GGUF-layout
// kernels below serve the AMX machines' small batches and the tests.
//
// llama.cpp's recipe: the activations are quantized to int8 per block of 32 (scale = absmax / 127), then each
// (weight block, activation block) pair is one 32-wide int8 dot product (_mm256_maddubs_epi16 after moving the
// weights' signs onto the activations), converted to float once per block and scaled by d_w · d_x. Decode is
// memory bound, so the point is to read 1.06 (Q8_0) or 0.56 (Q4_0) bytes per weight instead of 4; the integer
// dot products also keep small-batch matmuls (batch 2..64, prefill chunks) well below the memory time.
//
// Reference semantics: forwardpass/quant/reference.py (the same activation quantization bit for bit, then the
// same sums in float, so kernel and reference agree to float rounding). Threads: at::parallel_for over the
// output rows, i.e. torch's own OpenMP pool (the extension links the libgomp torch already loaded).
#include "torch_ext.h"  // forwardpass/csrc/: torch/extension.h less the C++ frontend
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "activations.h"
#include "block_weights.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include "vnni_gemm.h"  // many rows
#include "tiles.h"      // the tile layout's small-batch matmul
#else
#include "tiles_avx2.h"  // the tile layout's small-batch matmul
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

// int8 · int8 over one block, as 8 int32 partial sums converted to float. maddubs wants one unsigned operand:
// |w| and x carrying w's sign give the same products (llama.cpp's trick; no int16 overflow for |x| <= 127).
inline __m256 dot_block(__m256i w_abs, __m256i w, __m256i x) {
  const __m256i p16 = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(x, w));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}

// MR activation rows × NR weight rows, all blocks: MR·NR independent accumulators.
template <bool Q4, int MR, int NR>
void micro(const uint8_t* wq, int64_t w_stride, const at::Half* wd, int64_t nb, const int8_t* xq,
           const float* xd, int64_t m0, int64_t n0, int64_t N, float* out) {
  __m256 acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i xs[MR];
    float xds[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      xs[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (m0 + i) * nb * QK + b * QK));
      xds[i] = xd[(m0 + i) * nb + b];
    }
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      const __m256i w = load_block<Q4>(wq + (n0 + j) * w_stride, b);
      const __m256i wa = _mm256_sign_epi8(w, w);
      const float dw = _cvtsh_ss(wd[(n0 + j) * nb + b].x);  // F16C, not c10::Half's bit-twiddling
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i)
        acc[i][j] = _mm256_fmadd_ps(dot_block(wa, w, xs[i]), _mm256_set1_ps(dw * xds[i]), acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) out[(m0 + i) * N + n0 + j] = hsum(acc[i][j]);
}

template <bool Q4, int MR>
void rows(const uint8_t* wq, int64_t w_stride, const at::Half* wd, int64_t nb, const int8_t* xq, const float* xd,
          int64_t m0, int64_t n_begin, int64_t n_end, int64_t N, float* out) {
  // One activation row streams the weights: 4 rows at a time for 4 independent FMA chains. More activation
  // rows reuse each loaded weight block MR times: 2 weight rows keep MR·2 accumulators within 16 registers.
  constexpr int NR = MR == 1 ? 4 : 2;
  int64_t n = n_begin;
  for (; n + NR <= n_end; n += NR) micro<Q4, MR, NR>(wq, w_stride, wd, nb, xq, xd, m0, n, N, out);
  for (; n < n_end; ++n) micro<Q4, MR, 1>(wq, w_stride, wd, nb, xq, xd, m0, n, N, out);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// ---- AVX-512 VNNI: two blocks per instruction -----------------------------------------------------------
// vpdpbusd multiplies unsigned by signed bytes and sums each 4 into an int32 lane, no intermediate
// saturation: 64 products in one instruction where AVX2 needs sign, maddubs and madd for 32. The weights
// are made unsigned by an offset: Q8_0's w ^ 0x80 = w + 128, Q4_0's nibbles q = w + 8 as stored; the
// offset's contribution, 128·Σx or 8·Σx over each lane's 4 activations, depends only on the activations,
// so it is computed once per activation row (`corr`, negated) and starts each lane's sum. The lane sums are the
// AVX2 path's exactly; only the order of the float additions differs.
//
// Activation layout per pair of blocks (b, b+1), 64 bytes, matching how the weights load:
//   Q8_0: x_b[0:32], x_b1[0:32] (the stored order); scales [s_b ×8, s_b1 ×8]
//   Q4_0: x_b[0:16], x_b1[0:16], x_b[16:32], x_b1[16:32]: the pair's 32 bytes of nibbles are broadcast to
//         both halves of a register and the upper half shifted by 4, so the unpacked weights come as
//         [b.lo, b1.lo, b.hi, b1.hi] (lo nibbles are elements 0..15, hi 16..31) in two instructions;
//         the activations are stored in that order once instead. Scales [s_b ×4, s_b1 ×4] twice.

struct Activations512 {
  const int8_t* xq;      // [M, nbp·32], nbp = nb rounded up to even (a zero block pads an odd nb)
  const int32_t* corr;   // [M, nbp·8]: -offset · (sum of the lane's 4 activations), vpdpbusd's starting value
  const float* xd;       // [M, nbp]
  int64_t nbp;
};

template <bool Q4>
inline __m512i load_pair512(const uint8_t* row, int64_t b, bool single) {
  if constexpr (Q4) {
    // [t_b, t_b1, t_b, t_b1] >> [0, 0, 4, 4] & 15 = [b.lo, b1.lo, b.hi, b1.hi]
    const __m512i both = single ? _mm512_broadcast_i64x4(_mm256_maskz_loadu_epi8(0xFFFFu, row + b * QK / 2))
                                : _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * QK / 2)));
    const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    return _mm512_and_si512(_mm512_srlv_epi16(both, shifts), _mm512_set1_epi8(0x0F));
  } else {
    const __m512i w = single ? _mm512_maskz_loadu_epi8(0xFFFFFFFFull, row + b * QK)
                             : _mm512_loadu_si512(row + b * QK);
    return _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80)));
  }
}

// the two blocks' weight scales d_w[b], d_w[b+1] (the second is 0 past the row's end)
inline __m128 pair_scales(const at::Half* wd, int64_t b, bool single) {
  const uint32_t bits = single ? wd[b].x : (static_cast<uint32_t>(wd[b + 1].x) << 16) | wd[b].x;
  return _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(bits)));
}

constexpr int64_t PF_ROWS = 8;

template <bool Q4, int MR, int NR>
void micro512(const uint8_t* wq, int64_t w_stride, const at::Half* wd, int64_t nb, const Activations512& a,
              int64_t m0, int64_t n0, int64_t N, float* out) {
  const __m512i spread = Q4 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1)
                            : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  __m512 acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t b = 0;
  // Groups of 16 blocks: the scales of 16 blocks are converted with one vcvtph2ps per weight row and
  // loaded as one vector per activation row; each pair then only permutes them into place.
  for (; b + 16 <= nb; b += 16) {
    // d_w · d_x of the 16 blocks for each (weight row, activation row), one multiply per 16 blocks (the same
    // float32 products as the tail below, computed before the permute instead of after)
    __m512 scale16[MR][NR];
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      const __m512 dw16 =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wd + (n0 + j) * nb + b)));
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) scale16[i][j] = _mm512_mul_ps(dw16, _mm512_loadu_ps(a.xd + (m0 + i) * a.nbp + b));
    }
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
      const int64_t bb = b + 2 * k;
      const __m512i idx = _mm512_add_epi32(spread, _mm512_set1_epi32(2 * k));
      __m512i xs[MR], cs[MR];
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const int64_t m = m0 + i;
        xs[i] = _mm512_loadu_si512(a.xq + m * a.nbp * QK + bb * QK);
        cs[i] = _mm512_loadu_si512(a.corr + m * a.nbp * 8 + bb * 8);
      }
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) {
        const uint8_t* row = wq + (n0 + j) * w_stride;
        _mm_prefetch(reinterpret_cast<const char*>(row + PF_ROWS * w_stride + bb * (Q4 ? QK / 2 : QK)), _MM_HINT_T0);
        const __m512i w = load_pair512<Q4>(row, bb, false);
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
          const __m512i dot = _mm512_dpbusd_epi32(cs[i], w, xs[i]);
          acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(idx, scale16[i][j]), acc[i][j]);
        }
      }
    }
  }
  for (; b < nb; b += 2) {
    const bool single = b + 1 == nb;
    __m512i xs[MR], cs[MR];
    __m128 xds[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const int64_t m = m0 + i;
      xs[i] = _mm512_loadu_si512(a.xq + m * a.nbp * QK + b * QK);
      cs[i] = _mm512_loadu_si512(a.corr + m * a.nbp * 8 + b * 8);
      xds[i] = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(a.xd + m * a.nbp + b)));
    }
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      const uint8_t* row = wq + (n0 + j) * w_stride;
      // the rows two tiles ahead, one cache line per row and pair of blocks (the hardware prefetcher
      // stops at page boundaries; these rows are often only 0.5-1 KB long)
      _mm_prefetch(reinterpret_cast<const char*>(row + PF_ROWS * w_stride + b * (Q4 ? QK / 2 : QK)), _MM_HINT_T0);
      const __m512i w = load_pair512<Q4>(row, b, single);
      const __m128 dw = pair_scales(wd + (n0 + j) * nb, b, single);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m512i dot = _mm512_dpbusd_epi32(cs[i], w, xs[i]);
        const __m512 scale = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_mul_ps(dw, xds[i])));
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[i][j]);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      const __m512 v = acc[i][j];
      out[(m0 + i) * N + n0 + j] = hsum(_mm256_add_ps(
          _mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
    }
}

template <bool Q4, int MR>
void rows512(const uint8_t* wq, int64_t w_stride, const at::Half* wd, int64_t nb, const Activations512& a,
             int64_t m0, int64_t n_begin, int64_t n_end, int64_t N, float* out) {
  // One activation row (batch-1 decode) reads one weight row at a time, front to back: a single stream per
  // thread. Four rows side by side (four streams 1-3 KB apart, as the AVX2 path does) read DRAM-resident
  // weights at 18-26 GB/s on a Zen 4 core pair, one row at 27-35 (the 0.6B model's shapes and its LM head),
  // though from L2 one row computes at ~35 GB/s per core: the limit is the memory streams, not the kernel.
  constexpr int NR = MR == 1 ? 1 : 2;
  int64_t n = n_begin;
  for (; n + NR <= n_end; n += NR) micro512<Q4, MR, NR>(wq, w_stride, wd, nb, a, m0, n, N, out);
  for (; n < n_end; ++n) micro512<Q4, MR, 1>(wq, w_stride, wd, nb, a, m0, n, N, out);
}

// x → the pair layout's int8 values (zero-padded to an even number of blocks), scales and lane corrections
template <bool Q4>
void prepare512(const float* x, int64_t M, int64_t K, int64_t nb, int64_t nbp, int8_t* xq, float* xd,
                int32_t* corr) {
  const int32_t offset = Q4 ? 8 : 128;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      int8_t* q = xq + m * nbp * QK;
      float* d = xd + m * nbp;
      quantize_row(x + m * K, K, nb, q, d);
      if (nbp > nb) {
        std::memset(q + nb * QK, 0, QK);
        d[nb] = 0.0f;
      }
      for (int64_t b = 0; b < nbp; b += 2) {
        __m512i v = _mm512_loadu_si512(q + b * QK);
        if constexpr (Q4) {  // 16-byte chunks [b lo, b hi, b1 lo, b1 hi] → [b lo, b1 lo, b hi, b1 hi]
          v = _mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(3, 1, 2, 0));
          _mm512_storeu_si512(q + b * QK, v);
        }
        const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), v);
        _mm512_storeu_si512(corr + m * nbp * 8 + b * 8, _mm512_mullo_epi32(sums, _mm512_set1_epi32(-offset)));
      }
    }
  });
}
#endif

// Each thread takes a contiguous range of output rows (weights are read once in total). Within it, a tile of
// 16 weight rows (≤ 48 KB at K = 3072, in L2) is reused by every group of 4 activation rows, then by the 1-3
// left: ``rows.template operator()<MR>(m, n0, n1)`` computes activation rows m..m+MR against tile rows n0..n1.
template <typename Rows>
void over_tiles(int64_t M, int64_t N, Rows&& rows) {
  constexpr int64_t NT = 16;
  at::parallel_for(0, (N + NT - 1) / NT, 1, [&](int64_t t_begin, int64_t t_end) {
    for (int64_t t = t_begin; t < t_end; ++t) {
      const int64_t n0 = t * NT, n1 = std::min(N, n0 + NT);
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) rows.template operator()<4>(m, n0, n1);
      switch (M - m) {
        case 3: rows.template operator()<3>(m, n0, n1); break;
        case 2: rows.template operator()<2>(m, n0, n1); break;
        case 1: rows.template operator()<1>(m, n0, n1); break;
        default: break;
      }
    }
  });
}

// x [M, K] → the activations of the tile kernels (tiles.h, tiles_avx2.h) and the GEMM (vnni_gemm.h): int8 blocks
// and scales by quantize_row (the same bytes as the matvec path) and each block's starting value -offset · Σ block.
struct GemmActivations {
  torch::Tensor xq, xd, xc;
};

template <bool Q4>
GemmActivations prepare_gemm(const torch::Tensor& x, int64_t M, int64_t K, int64_t nb) {
  auto xq = torch::empty({M, nb * QK}, x.options().dtype(torch::kInt8));
  auto xd = torch::empty({M, nb}, x.options());
  auto xc = torch::empty({M, nb}, x.options().dtype(torch::kInt32));
  const float* xp = x.data_ptr<float>();
  int8_t* xqp = xq.data_ptr<int8_t>();
  float* xdp = xd.data_ptr<float>();
  int32_t* xcp = xc.data_ptr<int32_t>();
  const int32_t offset = Q4 ? 8 : 128;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      quantize_row(xp + m * K, K, nb, xqp + m * nb * QK, xdp + m * nb);
      for (int64_t b = 0; b < nb; ++b) {  // the block's sum: maddubs by 1 (exact for |x| <= 127), then madd
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xqp + m * nb * QK + b * QK));
        const __m256i s32 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), v), _mm256_set1_epi16(1));
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
        xcp[m * nb + b] = -offset * _mm_cvtsi128_si32(t);
      }
    }
  });
  return {xq, xd, xc};
}

// Small batches (decode) with W in the tile layout: tiles::tile_rows (tiles.h, or tiles_avx2.h in the AVX2 build)
// over the tiles as over_tiles hands them out. Each thread's range of tiles is one memory stream (the hardware
// prefetcher follows it; software prefetching measured no better).
template <bool Q4>
torch::Tensor quant_matmul_tiles(torch::Tensor x, torch::Tensor wq, torch::Tensor wd) {
  const BlockMatmulShape shape = check_block_matmul<Q4>(x, wq, wd);
  const GemmActivations a = prepare_gemm<Q4>(x, shape.M, shape.K, shape.nb);
  auto out = torch::empty({shape.M, shape.N}, x.options());
  const int8_t* xq = a.xq.data_ptr<int8_t>();
  const float* xd = a.xd.data_ptr<float>();
  const int32_t* xc = a.xc.data_ptr<int32_t>();
  const uint8_t* wqp = reinterpret_cast<const uint8_t*>(wq.data_ptr());
  const at::Half* wdp = wd.data_ptr<at::Half>();
  float* y = out.data_ptr<float>();
  over_tiles(shape.M, shape.N, [&]<int MR>(int64_t m, int64_t n0, int64_t) {
    const tiles::Tile tile = tiles::tile_of(n0 / 16, shape.N, shape.w_stride, shape.nb);
    tiles::tile_rows<Q4, MR>(wqp + tile.w_offset, wdp + tile.d_offset, tile.rows, shape.nb, xq, xd, xc, m, y,
                             shape.N, n0);
  });
  return out;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// Many activation rows (prefill chunks, large decode batches): the GEMM of vnni_gemm.h, W in the tile layout.
template <bool Q4>
torch::Tensor quant_gemm_tiles(torch::Tensor x, torch::Tensor wq, torch::Tensor wd) {
  const BlockMatmulShape shape = check_block_matmul<Q4>(x, wq, wd);
  const GemmActivations a = prepare_gemm<Q4>(x, shape.M, shape.K, shape.nb);
  auto out = torch::empty({shape.M, shape.N}, x.options());
  vnni_gemm::gemm<Q4>(a.xq.data_ptr<int8_t>(), a.xd.data_ptr<float>(), a.xc.data_ptr<int32_t>(), shape.M,
                      reinterpret_cast<const uint8_t*>(wq.data_ptr()), shape.w_stride, wd.data_ptr<at::Half>(),
                      shape.nb, shape.N, out.data_ptr<float>());
  return out;
}
#endif

template <bool Q4>
torch::Tensor quant_matmul(torch::Tensor x, torch::Tensor wq, torch::Tensor wd) {
  const BlockMatmulShape shape = check_block_matmul<Q4>(x, wq, wd);
  const int64_t M = shape.M, K = shape.K, N = shape.N, nb = shape.nb, w_stride = shape.w_stride;
  auto out = torch::empty({M, N}, x.options());
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  if (M >= 1) {  // every batch the caller sends here (prefill-sized ones go to a float GEMM, weight.py)
    const int64_t nbp = (nb + 1) / 2 * 2;
    auto xq5 = torch::empty({M, nbp * QK}, x.options().dtype(torch::kInt8));
    auto xd5 = torch::empty({M, nbp}, x.options());
    auto corr = torch::empty({M, nbp * 8}, x.options().dtype(torch::kInt32));
    prepare512<Q4>(x.data_ptr<float>(), M, K, nb, nbp, xq5.data_ptr<int8_t>(), xd5.data_ptr<float>(),
                   corr.data_ptr<int32_t>());
    const Activations512 acts{xq5.data_ptr<int8_t>(), corr.data_ptr<int32_t>(), xd5.data_ptr<float>(), nbp};
    const uint8_t* wqp = reinterpret_cast<const uint8_t*>(wq.data_ptr());
    const at::Half* wdp = wd.data_ptr<at::Half>();
    float* op = out.data_ptr<float>();
    over_tiles(M, N, [&]<int MR>(int64_t m, int64_t n0, int64_t n1) {
      rows512<Q4, MR>(wqp, w_stride, wdp, nb, acts, m, n0, n1, N, op);
    });
    return out;
  }
#endif
  auto xq = torch::empty({M, nb * QK}, x.options().dtype(torch::kInt8));
  auto xd = torch::empty({M, nb}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* xqp = xq.data_ptr<int8_t>();
  float* xdp = xd.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) quantize_row(xp + m * K, K, nb, xqp + m * nb * QK, xdp + m * nb);
  });
  const uint8_t* wqp = reinterpret_cast<const uint8_t*>(wq.data_ptr());
  const at::Half* wdp = wd.data_ptr<at::Half>();
  float* op = out.data_ptr<float>();
  over_tiles(M, N, [&]<int MR>(int64_t m, int64_t n0, int64_t n1) {
    rows<Q4, MR>(wqp, w_stride, wdp, nb, xqp, xdp, m, n0, n1, N, op);
  });
  return out;
}

// The 32 weights of block b of row r of a tile (R rows; tile_layout.h) as int8, as load_block gives them for
// the GGUF layout (Q4_0: minus 8). 8 consecutive k at a time — one Q4_0 group (its low nibbles are k .. k+3, the
// high ones k+4 .. k+7) or two Q8_0 ones — from 4-byte groups a tile's group stride apart.
template <bool Q4>
inline __m256i load_tile_block(const uint8_t* tw, int64_t R, int64_t r, int64_t b) {
  alignas(32) uint64_t eights[4];
  for (int64_t e = 0; e < 4; ++e) {  // k = 32b + 8e .. 32b + 8e + 7
    uint32_t v0, v1;
    if constexpr (Q4) {
      std::memcpy(&v0, tw + tiles::group_offset<true>(b, e, R, r), 4);
      eights[e] = (v0 & 0x0F0F0F0Fu) | (static_cast<uint64_t>((v0 >> 4) & 0x0F0F0F0Fu) << 32);
    } else {
      std::memcpy(&v0, tw + tiles::group_offset<false>(b, 2 * e, R, r), 4);
      std::memcpy(&v1, tw + tiles::group_offset<false>(b, 2 * e + 1, R, r), 4);
      eights[e] = v0 | (static_cast<uint64_t>(v1) << 32);
    }
  }
  const __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i*>(eights));
  return Q4 ? _mm256_sub_epi8(w, _mm256_set1_epi8(8)) : w;
}

// Weights back to fp32 or bf16 [N, K] (w = q · d, one float multiply per weight: bitwise formats.dequantize,
// then for bf16 torch's rounding), from the GGUF layout or (Tiles) the tile layout. For large batches (prefill
// chunks) a float GEMM on the dequantized rows beats the int8 dot products (see weight.py); bf16 where the CPU
// multiplies bf16 fast (AMX, AVX512-BF16). Threads take 16 rows at a time (whole tiles; a tile's 16·K bytes stay
// in L1/L2 while its rows are written out).
template <bool Q4, typename Out, bool Tiles = false>
torch::Tensor dequantize(torch::Tensor wq, torch::Tensor wd, int64_t K) {
  wq = wq.contiguous();
  wd = wd.contiguous();
  const int64_t N = wq.size(0), nb = wd.size(1);
  TORCH_CHECK(nb * QK >= K && (nb - 1) * QK < K, "scales do not match K=", K);
  const int64_t w_stride = Q4 ? nb * QK / 2 : nb * QK;
  auto out = torch::empty({N, K}, torch::dtype(c10::CppTypeToScalarType<Out>::value));
  const uint8_t* wqp = reinterpret_cast<const uint8_t*>(wq.data_ptr());
  const at::Half* wdp = wd.data_ptr<at::Half>();
  Out* op = out.template data_ptr<Out>();
  at::parallel_for(0, (N + 15) / 16, 1, [&](int64_t t_begin, int64_t t_end) {
    Out buf[QK];
    for (int64_t t = t_begin; t < t_end; ++t) {
      const tiles::Tile tile = tiles::tile_of(t, N, w_stride, nb);
      for (int64_t r = 0; r < tile.rows; ++r) {
        const int64_t n = 16 * t + r;
        for (int64_t b = 0; b < nb; ++b) {
          const __m256i w = Tiles ? load_tile_block<Q4>(wqp + tile.w_offset, tile.rows, r, b)
                                  : load_block<Q4>(wqp + n * w_stride, b);
          const at::Half dw = Tiles ? wdp[tile.d_offset + b * tile.rows + r] : wdp[n * nb + b];
          const __m256 d = _mm256_set1_ps(_cvtsh_ss(dw.x));
          const int64_t len = std::min<int64_t>(QK, K - b * QK);
          Out* dst = len == QK ? op + n * K + b * QK : buf;
          const __m128i lo = _mm256_castsi256_si128(w), hi = _mm256_extracti128_si256(w, 1);
          store8(dst, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), d));
          store8(dst + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), d));
          store8(dst + 16, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), d));
          store8(dst + 24, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), d));
          if (len < QK) std::memcpy(op + n * K + b * QK, buf, len * sizeof(Out));
        }
      }
    }
  });
  return out;
}

std::vector<torch::Tensor> quantize_activations(torch::Tensor x) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "x must be a 2-D float32 tensor");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), nb = (K + QK - 1) / QK;
  auto q = torch::empty({M, nb * QK}, x.options().dtype(torch::kInt8));
  auto d = torch::empty({M, nb}, x.options());
  for (int64_t m = 0; m < M; ++m)
    quantize_row(x.data_ptr<float>() + m * K, K, nb, q.data_ptr<int8_t>() + m * nb * QK, d.data_ptr<float>() + m * nb);
  return {q, d};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q8_0_matmul", &quant_matmul<false>, "x[M,K] fp32 · Q8_0 W[N,K]ᵀ (values int8 [N,Kp], scales fp16 [N,Kp/32])");
  m.def("q4_0_matmul", &quant_matmul<true>, "x[M,K] fp32 · Q4_0 W[N,K]ᵀ (nibbles uint8 [N,Kp/2], scales fp16 [N,Kp/32])");
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  m.def("q8_0_gemm_tiles", &quant_gemm_tiles<false>, "x[M,K] fp32 · Q8_0 W[N,K]ᵀ, W in the tile layout (tiles.h), for many rows");
  m.def("q4_0_gemm_tiles", &quant_gemm_tiles<true>, "x[M,K] fp32 · Q4_0 W[N,K]ᵀ, W in the tile layout (tiles.h), for many rows");
  m.def("gemm_capsule", [](bool q4) {  // for C++ callers, as matmul_capsule below
    return py::capsule(q4 ? reinterpret_cast<void*>(&quant_gemm_tiles<true>) : reinterpret_cast<void*>(&quant_gemm_tiles<false>),
                       "forwardpass.quant_matmul");
  }, "the q4_0 (True) or q8_0 (False) GEMM for the tile layout, as a PyCapsule", py::arg("q4"));
#endif
  m.def("q8_0_matmul_tiles", &quant_matmul_tiles<false>, "q8_0_matmul for W in the tile layout (tile_layout.h)");
  m.def("q4_0_matmul_tiles", &quant_matmul_tiles<true>, "q4_0_matmul for W in the tile layout (tile_layout.h)");
  m.def("q8_0_dequantize_tiles", &dequantize<false, float, true>, "q8_0_dequantize for W in the tile layout");
  m.def("q4_0_dequantize_tiles", &dequantize<true, float, true>, "q4_0_dequantize for W in the tile layout");
  m.def("q8_0_dequantize_tiles_bf16", &dequantize<false, at::BFloat16, true>, "q8_0_dequantize_bf16, tile layout");
  m.def("q4_0_dequantize_tiles_bf16", &dequantize<true, at::BFloat16, true>, "q4_0_dequantize_bf16, tile layout");
  m.def("q8_0_dequantize", &dequantize<false, float>, "Q8_0 (values, scales, K) → fp32 [N, K]");
  m.def("q4_0_dequantize", &dequantize<true, float>, "Q4_0 (values, scales, K) → fp32 [N, K]");
  m.def("q8_0_dequantize_bf16", &dequantize<false, at::BFloat16>, "Q8_0 (values, scales, K) → bf16 [N, K]");
  m.def("q4_0_dequantize_bf16", &dequantize<true, at::BFloat16>, "Q4_0 (values, scales, K) → bf16 [N, K]");
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  m.attr("isa") = "avx512vnni";
#else
  m.attr("isa") = "avx2";
#endif
  m.def("quantize_activations", &quantize_activations, "x[M,K] fp32 → (int8 [M,Kp], fp32 scales [M,Kp/32])");
  // the matvec entry points for C++ callers (attention/csrc/decode_stack.h), named after their signature
  m.def("matmul_capsule", [](bool q4, bool tiles) {
    if (tiles)
      return py::capsule(q4 ? reinterpret_cast<void*>(&quant_matmul_tiles<true>) : reinterpret_cast<void*>(&quant_matmul_tiles<false>),
                         "forwardpass.quant_matmul");
    return py::capsule(reinterpret_cast<void*>(q4 ? &quant_matmul<true> : &quant_matmul<false>),
                       "forwardpass.quant_matmul");
  }, "the q4_0 (True) or q8_0 (False) matmul, for the GGUF or the tile layout, as a PyCapsule",
     py::arg("q4"), py::arg("tiles") = false);
}
