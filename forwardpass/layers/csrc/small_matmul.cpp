// fp32 matmul for small batches (decode steps): y[M, N] = x[M, K] · W[N, K]ᵀ (+ bias), W either in its
// checkpoint layout (row n holds output n's K weights contiguously) or in the panels oneDNN packed it into
// once, when the engine was built (layers/packed.py; the panel:: kernel below). Nothing is packed or copied
// per call.
//
// Why: a decode step multiplies a handful of rows by every weight of the model once. The library GEMMs are
// built for large M: MKL's sgemm re-packs W on every call (measured on an AVX-512 Xeon: 16 rows × a 25 MB
// weight took 3× as long as one row), and oneDNN's linear costs ~30 µs of set-up per call. Here each weight
// is read once from memory and used against every activation row while it is in cache:
//
// * the output rows are split in tiles of 16 weight rows over the threads (torch's OpenMP pool);
// * within a tile, groups of NR weight rows × MR activation rows are one register block: NR·MR vector
//   accumulators along K (lanes hold partial sums of different k), one load per weight vector used by MR
//   FMAs; the horizontal sums happen once per output at the end. The tile (16 × K floats, ≤ 256 KB at
//   K = 4096) stays in L2 while the activation-row groups pass over it.
//
// The float sums run in a different order than the library GEMMs (lane-wise partial sums, then a tree),
// so results agree with ``x @ W.T`` to rounding (tests/test_small_matmul.py bounds it), not bit for bit.
// Built twice: AVX-512 (16 lanes, 4 × 4 blocks in 32 registers) and AVX2/FMA (8 lanes, 2 × 4 blocks in 16).
#include "torch_ext.h"  // forwardpass/csrc/: torch/extension.h less the C++ frontend
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

namespace {

#if defined(__AVX512F__)
struct Vec {
  using T = __m512;
  static constexpr int64_t L = 16;
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T bcast(const float* p) { return _mm512_set1_ps(*p); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static float sum(T v) { return _mm512_reduce_add_ps(v); }
};
constexpr int MR_MAX = 4;  // activation rows per register block: 16 accumulators + 4 weight vectors + 1
#else
struct Vec {
  using T = __m256;
  static constexpr int64_t L = 8;
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static float sum(T v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};
constexpr int MR_MAX = 2;  // 8 accumulators + 4 weight vectors + 1 of the 16 AVX2 registers
#endif

constexpr int NR = 4;        // weight rows per register block
constexpr int64_t NT = 16;   // weight rows per thread tile
#if defined(__AVX512F__)
constexpr int64_t BCAST_ROWS = 17;  // from this many rows on, the broadcast kernel below
#endif

// Rows m..m+MR of x against weight rows n..n+NRB: the register block.
// `next` (or null): the same rows of the thread's next tile; rows pf0, pf0 + pf_step, ... of them are prefetched
// into L2 a line per step as this block reads its own, so the next tile streams in from memory while this one
// computes (each group of activation rows takes its share of the rows).
template <int MR, int NRB>
inline void block(const float* x, int64_t K, const float* w, int64_t m, int64_t n, const float* bias, float* y,
                  int64_t N, const float* next, int pf0, int pf_step) {
  typename Vec::T acc[MR][NRB];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NRB; ++j) acc[i][j] = Vec::zero();
  const float* xr[MR];
  const float* wr[NRB];
  for (int i = 0; i < MR; ++i) xr[i] = x + (m + i) * K;
  for (int j = 0; j < NRB; ++j) wr[j] = w + (n + j) * K;
  const int64_t kv = K / Vec::L * Vec::L;
  for (int64_t k = 0; k < kv; k += Vec::L) {
    if (next != nullptr)
      for (int j = pf0; j < NRB; j += pf_step) _mm_prefetch(reinterpret_cast<const char*>(next + j * K + k), _MM_HINT_T1);
    typename Vec::T wv[NRB];
    for (int j = 0; j < NRB; ++j) wv[j] = Vec::load(wr[j] + k);
    for (int i = 0; i < MR; ++i) {
      const typename Vec::T xv = Vec::load(xr[i] + k);
      for (int j = 0; j < NRB; ++j) acc[i][j] = Vec::fma(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NRB; ++j) {
      float s = Vec::sum(acc[i][j]);
      for (int64_t k = kv; k < K; ++k) s += xr[i][k] * wr[j][k];  // K not a multiple of the vector width
      y[(m + i) * N + n + j] = bias ? s + bias[n + j] : s;
    }
}

// One activation row (batch-1 decode): one weight row at a time, front to back, a single memory stream per
// thread. Four weight rows side by side (block<1, 4>) are four streams a row apart; a decode token's matmuls of
// the 0.6B model (2.4 GB, on 2 MB pages) read 25-35 GB/s that way and 30-55 one row at a time on a Zen 4 core
// pair (alternating runs). The same sums in the same order as block<MR, NRB>, so a row's result does not depend
// on how many rows share the call.
inline void row1(const float* x, int64_t K, const float* w, int64_t n0, int64_t n1, const float* bias, float* y) {
  const int64_t kv = K / Vec::L * Vec::L;
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = w + n * K;
    typename Vec::T acc = Vec::zero();
    for (int64_t k = 0; k < kv; k += Vec::L) acc = Vec::fma(Vec::load(x + k), Vec::load(wr + k), acc);
    float s = Vec::sum(acc);
    for (int64_t k = kv; k < K; ++k) s += x[k] * wr[k];  // K not a multiple of the vector width
    y[n] = bias ? s + bias[n] : s;
  }
}

// Activation rows m..m+MR (group g of `groups`) against the tile's weight rows n0..n1.
template <int MR>
inline void rows(const float* x, int64_t K, const float* w, int64_t m, int64_t n0, int64_t n1, const float* bias,
                 float* y, int64_t N, int g, int groups, int64_t batch_rows) {
  if (batch_rows == 1) {
    row1(x, K, w, n0, n1, bias, y);
    return;
  }
  int64_t n = n0;
  const int pf0 = g % groups, pf_step = groups;  // this group's share of the next tile's rows
  auto next = [&](int64_t r) { return r + NT < N ? w + (r + NT) * K : nullptr; };
  for (; n + NR <= n1; n += NR) block<MR, NR>(x, K, w, m, n, bias, y, N, next(n), pf0, pf_step);
  switch (n1 - n) {
    case 3: block<MR, 3>(x, K, w, m, n, bias, y, N, next(n), pf0, pf_step); break;
    case 2: block<MR, 2>(x, K, w, m, n, bias, y, N, next(n), pf0, pf_step); break;
    case 1: block<MR, 1>(x, K, w, m, n, bias, y, N, next(n), pf0, pf_step); break;
    default: break;
  }
}

// ---- weights in panels (oneDNN's blocked layout, layers/packed.py) ---------------------------------
//
// A packed weight is [N/64][Kp][64]: for each block of 64 output rows a panel holding, for k = 0..K-1 (Kp ≥ K
// padded), the 64 weights of that k side by side. oneDNN's GEMM reads it as is (prefill), and it makes the
// small-batch kernel simple: per k, the panel's 64 weights are NV vector loads against one broadcast
// activation per row; the lanes hold 64 different outputs, and a thread's panels are one front-to-back memory
// stream. Every output is one FMA chain in k order, whatever the number of rows, so a row's result does not
// depend on the batch it shares a call with. Rows go in register blocks of MR; for more than MR rows, K goes
// in chunks whose part of the panel stays in cache while every row block passes over it, the partial sums
// parked in y (a stored and reloaded float is the same float: chunking does not change a sum).
//
// Measured on a Zen 4 core pair against the checkpoint-layout kernels above (0.6B and 41M model shapes,
// medians): AVX-512 1.0-1.2x at 1 row, 1.3-1.4x at 8-16, 1.05-1.3x at 64, and level with oneDNN on the same
// panels at 128; the AVX2 build (one row, all 64 outputs in 8 registers, 64-k chunks: 16 KB, L1) level at 2-8
// rows and 1.1-1.25x at 16-64 (a 2-row block on half panels, 13 of the 16 registers, was 0.6-0.9x below 32
// rows).
namespace panel {

constexpr int64_t P = 64;   // outputs per panel
constexpr int NV = P / Vec::L;  // vectors per panel row
#if defined(__AVX512F__)
constexpr int MR = 6;       // rows per register block: 24 accumulators + 4 weight vectors + a broadcast
constexpr int64_t KC = 256; // k per chunk: 64 KB of panel, in L2 while the row blocks pass
#else
constexpr int MR = 1;       // 8 accumulators over all 64 outputs, within the 16 registers
constexpr int64_t KC = 64;  // 16 KB of panel, in L1
#endif

// rows x[0..R) against the panel w, k in [k0, k1) → y[i][col..col+64) (rows N apart); `first`: start
// the sums at zero, else continue those parked in y; `last`: add the bias
template <int R>
inline void block(const float* x, int64_t K, const float* w, int64_t k0, int64_t k1, float* y, int64_t N,
                  int64_t col, const float* bias, bool first, bool last) {
  typename Vec::T acc[R][NV];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = first ? Vec::zero() : Vec::load(y + i * N + col + j * Vec::L);
  for (int64_t k = k0; k < k1; ++k) {
    typename Vec::T wv[NV];
    for (int j = 0; j < NV; ++j) wv[j] = Vec::load(w + k * P + j * Vec::L);
    for (int i = 0; i < R; ++i) {
      const typename Vec::T b = Vec::bcast(x + i * K + k);
      for (int j = 0; j < NV; ++j) acc[i][j] = Vec::fma(b, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) {
      typename Vec::T v = acc[i][j];
      if (last && bias) v = Vec::add(v, Vec::load(bias + col + j * Vec::L));
      Vec::store(y + i * N + col + j * Vec::L, v);
    }
}

// block<rows> for 1 ≤ rows ≤ R
template <int R>
inline void block_any(int64_t rows, const float* x, int64_t K, const float* w, int64_t k0, int64_t k1,
                      float* y, int64_t N, int64_t col, const float* bias, bool first, bool last) {
  if constexpr (R > 0) {
    if (rows == R) {
      block<R>(x, K, w, k0, k1, y, N, col, bias, first, last);
    } else {
      block_any<R - 1>(rows, x, K, w, k0, k1, y, N, col, bias, first, last);
    }
  }
}

void matmul(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t K, int64_t Kp,
            int64_t N) {
  const int64_t kc = M <= MR ? std::max<int64_t>(K, 1) : KC;  // one row block: no reuse to chunk K for
  at::parallel_for(0, N / P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const float* wp = w + p * Kp * P;
      for (int64_t k0 = 0; k0 < std::max<int64_t>(K, 1); k0 += kc) {
        const int64_t k1 = std::min(K, k0 + kc);
        for (int64_t m = 0; m < M; m += MR)
          block_any<MR>(std::min<int64_t>(MR, M - m), x + m * K, K, wp, k0, k1, y + m * N, N, p * P, bias,
                        k0 == 0, k1 >= K);
      }
    }
  });
}

}  // namespace panel

#include "half_panels.h"  // bfloat16 / float16 panels, upcast to fp32 in registers

#if defined(__AVX512F__)
#include "transpose16.h"  // forwardpass/csrc/

// ---- batches of 17+ rows (AVX-512 build): activations transposed, weights broadcast ---------------------
//
// The dot-product blocks above keep partial sums of different k in the lanes: every FMA needs a weight vector
// and an activation vector, and the weight tile is re-read from L2 for each group of 4 activation rows. From 16
// rows on that re-reading bounds it (~55% of the FMA units' peak). Here the lanes hold 16 activation ROWS
// instead: x is transposed once per call into xt [K][16·MV] (MV = 1..4 vectors = up to 64 rows), and each
// weight w[n][k] is broadcast from memory straight into its FMA (the load is part of the instruction), against
// the MV vectors of xt[k]: NR weight rows × MV vectors = 24 accumulators (12 for one vector), so per k one or a
// few vector loads feed NR·MV FMAs. Weights are still read in their checkpoint layout, nothing packed, and
// each weight row is prefetched 4 lines ahead (measured: 64 floats ahead beat none and 128).
//
// Outputs: the accumulators hold y[m][n] with m along the lanes, so they are stored to a small buffer and
// gathered out row by row. Sums run in k order per output (one fp32 FMA chain), like ``x @ W.T``'s naive
// definition; the library GEMMs split k differently, so results agree to rounding.
namespace bcast {

constexpr int64_t L = 16;      // lanes: activation rows per vector
constexpr int MV_MAX = 4;      // vectors per block: 64 activation rows
constexpr int64_t PF = 64;     // prefetch distance along a weight row, floats (4 cache lines)
constexpr int64_t PANEL_BYTES = 512 * 1024;  // weight rows a thread keeps in L2 across row blocks

// weight rows per register block for a block of MV vectors: NR·MV accumulators (24, or 12 for one vector:
// enough independent chains to cover the FMA latency) + MV activation vectors + a broadcast
constexpr int nr_for(int mv) { return mv == 1 ? 12 : mv == 2 ? 12 : mv == 3 ? 8 : 6; }

// c[j][v·16 + lane] = Σ_k xt[k][v·16 + lane] · w[j][k] for j < NR, v < MV (w rows ldw floats apart)
template <int MV, int NR>
inline void micro(const float* __restrict xt, const float* __restrict w, int64_t ldw, int64_t K, float* __restrict c) {
  __m512 acc[NR][MV];
  for (int j = 0; j < NR; ++j)
    for (int v = 0; v < MV; ++v) acc[j][v] = _mm512_setzero_ps();
  auto step = [&](int64_t k) {
    __m512 xv[MV];
    for (int v = 0; v < MV; ++v) xv[v] = _mm512_loadu_ps(xt + k * MV * L + v * L);
    for (int j = 0; j < NR; ++j) {
      const __m512 b = _mm512_set1_ps(w[j * ldw + k]);
      for (int v = 0; v < MV; ++v) acc[j][v] = _mm512_fmadd_ps(xv[v], b, acc[j][v]);
    }
  };
  int64_t k = 0;
  for (; k + L <= K; k += L) {
    for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + j * ldw + k + PF), _MM_HINT_T0);
#pragma GCC unroll 4
    for (int64_t kk = k; kk < k + L; ++kk) step(kk);
  }
  for (; k < K; ++k) step(k);
  for (int j = 0; j < NR; ++j)
    for (int v = 0; v < MV; ++v) _mm512_store_ps(c + (j * MV + v) * L, acc[j][v]);
}

inline __mmask16 first(int64_t n) { return n >= 16 ? 0xFFFF : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1); }

// One block of activation rows: x rows r0..r0+rows (rows ≤ 64) → xt [K][16·mv], rows past `rows` zero.
inline void transpose_block(const float* x, int64_t K, int64_t r0, int64_t rows, int mv, float* xt) {
  __m512 r[16];
  for (int v = 0; v < mv; ++v) {
    const int64_t here = std::min<int64_t>(L, rows - v * L);  // real rows in this vector (may be ≤ 0)
    for (int64_t k0 = 0; k0 < K; k0 += L) {
      const __mmask16 cols = first(K - k0);
      for (int i = 0; i < 16; ++i)
        r[i] = i < here ? _mm512_maskz_loadu_ps(cols, x + (r0 + v * L + i) * K + k0) : _mm512_setzero_ps();
      transpose16(r);
      for (int t = 0; t < 16 && k0 + t < K; ++t) _mm512_storeu_ps(xt + (k0 + t) * mv * L + v * L, r[t]);
    }
  }
}

// c [NR][16·mv] → y[r0 + m][n0 + j] (+ bias) for m < rows, j < cols
inline void store_block(const float* c, int mv, int64_t rows, int64_t cols, const float* bias, float* y,
                        int64_t N, int64_t r0, int64_t n0) {
  const __mmask16 mask = first(cols);
  const __m512i lane = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(static_cast<int>(mv * L)));
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int64_t m = 0; m < rows; ++m) {
    const __m512 row = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, lane, c + m, 4);
    _mm512_mask_storeu_ps(y + (r0 + m) * N + n0, mask, _mm512_add_ps(row, b));
  }
}

template <int NR>
inline void micro_any(int mv, const float* xt, const float* w, int64_t ldw, int64_t K, float* c) {
  switch (mv) {
    case 1: micro<1, NR>(xt, w, ldw, K, c); break;
    case 2: micro<2, NR>(xt, w, ldw, K, c); break;
    case 3: micro<3, NR>(xt, w, ldw, K, c); break;
    default: micro<4, NR>(xt, w, ldw, K, c); break;
  }
}

template <int NR>
void gemm(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t rblocks = (M + MV_MAX * L - 1) / (MV_MAX * L);
  const int64_t xt_block = K * MV_MAX * L;  // floats per transposed row block
  // every value a block's kernel reads is written by transpose_block (rows past M as zeros): no fill needed
  std::unique_ptr<float[]> xt(new float[rblocks * xt_block]);
  at::parallel_for(0, rblocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t rows = std::min<int64_t>(MV_MAX * L, M - b * MV_MAX * L);
      transpose_block(x, K, b * MV_MAX * L, rows, static_cast<int>((rows + L - 1) / L), xt.get() + b * xt_block);
    }
  });
  const int64_t nblocks = (N + NR - 1) / NR;
  // a thread's weight rows in panels that stay in L2 while every row block passes over them
  const int64_t panel = std::max<int64_t>(1, PANEL_BYTES / (NR * K * 4));
  at::parallel_for(0, nblocks, 1, [&](int64_t q0, int64_t q1) {
    alignas(64) float c[NR * MV_MAX * L];
    std::vector<float> wpad;  // the last weight rows padded to NR (N not a multiple of NR)
    for (int64_t p0 = q0; p0 < q1; p0 += panel) {
      const int64_t p1 = std::min(q1, p0 + panel);
      for (int64_t rb = 0; rb < rblocks; ++rb) {
        const int64_t r0 = rb * MV_MAX * L, rows = std::min<int64_t>(MV_MAX * L, M - r0);
        const int mv = static_cast<int>((rows + L - 1) / L);
        for (int64_t q = p0; q < p1; ++q) {
          const int64_t n0 = q * NR, cols = std::min<int64_t>(NR, N - n0);
          const float* wq = w + n0 * K;
          if (cols < NR) {
            if (wpad.empty()) {
              wpad.assign(NR * K, 0.f);
              std::copy(wq, wq + cols * K, wpad.begin());
            }
            wq = wpad.data();
          }
          micro_any<NR>(mv, xt.get() + rb * xt_block, wq, K, K, c);
          store_block(c, mv, rows, cols, bias, y, N, r0, n0);
        }
      }
    }
  });
}

}  // namespace bcast
#endif

}  // namespace

torch::Tensor small_matmul(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  const bool panels = w.dim() == 3;  // [N/64, Kp, 64] (panel::, half::), else [N, K]
  const bool half_panels = panels && (w.dtype() == torch::kBFloat16 || w.dtype() == torch::kHalf);
  TORCH_CHECK(x.dtype() == torch::kFloat32 && (w.dtype() == torch::kFloat32 || half_panels),
              "float32 activations and float32 weights (or bfloat16 / float16 panels) only");
  TORCH_CHECK(x.dim() == 2 && (panels ? w.size(2) == panel::P && x.size(1) <= w.size(1)
                                      : w.dim() == 2 && x.size(1) == w.size(1)),
              "x [M, K] and W [N, K] or panels [N/64, Kp >= K, 64] expected");
  if (panels) {
    TORCH_CHECK(w.is_contiguous(), "panels must be contiguous");  // a view of oneDNN's buffer: never copied
  } else {
    w = w.contiguous();
  }
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = panels ? w.size(0) * panel::P : w.size(0);
  torch::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.dtype() == torch::kFloat32 && b.numel() == N, "bias: [N] float32");
  }
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  if (half_panels) {
    const auto* hp = reinterpret_cast<const uint16_t*>(w.data_ptr());
    if (w.dtype() == torch::kBFloat16) {
      half::matmul<half::Kind::bf16>(xp, hp, bp, yp, M, K, w.size(1), N);
    } else {
      half::matmul<half::Kind::fp16>(xp, hp, bp, yp, M, K, w.size(1), N);
    }
    return y;
  }
  const float* wp = w.data_ptr<float>();
  if (panels) {
    panel::matmul(xp, wp, bp, yp, M, K, w.size(1), N);
    return y;
  }
#if defined(__AVX512F__)
  if (M >= BCAST_ROWS && K > 0) {
    if (M <= 2 * bcast::L) {
      bcast::gemm<bcast::nr_for(2)>(xp, wp, bp, yp, M, K, N);
    } else if (M <= 3 * bcast::L) {
      bcast::gemm<bcast::nr_for(3)>(xp, wp, bp, yp, M, K, N);
    } else {
      bcast::gemm<bcast::nr_for(4)>(xp, wp, bp, yp, M, K, N);
    }
    return y;
  }
#endif
  at::parallel_for(0, (N + NT - 1) / NT, 1, [&](int64_t t_begin, int64_t t_end) {
    for (int64_t t = t_begin; t < t_end; ++t) {
      const int64_t n0 = t * NT, n1 = std::min(N, n0 + NT);
      const int groups = static_cast<int>((M + MR_MAX - 1) / MR_MAX);
      int64_t m = 0;
      for (; m + MR_MAX <= M; m += MR_MAX) rows<MR_MAX>(xp, K, wp, m, n0, n1, bp, yp, N, m / MR_MAX, groups, M);
      if constexpr (MR_MAX > 3) {
        if (M - m == 3) rows<3>(xp, K, wp, m, n0, n1, bp, yp, N, m / MR_MAX, groups, M);
      }
      if constexpr (MR_MAX > 2) {
        if (M - m == 2) rows<2>(xp, K, wp, m, n0, n1, bp, yp, N, m / MR_MAX, groups, M);
      }
      if (M - m == 1) rows<1>(xp, K, wp, m, n0, n1, bp, yp, N, m / MR_MAX, groups, M);
    }
  });
  return y;
}

// A tensor [panels, Kp, 64] over `ptr` (the buffer of oneDNN's packed weight `owner`, an opaque MKLDNN
// tensor), which the view keeps alive: layers/packed.py reads the packed weight through it.
torch::Tensor panels_view(torch::Tensor owner, int64_t ptr, int64_t panels, int64_t kp) {
  TORCH_CHECK(ptr != 0 && panels > 0 && kp > 0, "a packed buffer expected");
  return torch::from_blob(reinterpret_cast<void*>(ptr), {panels, kp, panel::P}, [owner](void*) {},
                          torch::TensorOptions().dtype(torch::kFloat32));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("panels_view", &panels_view, "a [panels, Kp, 64] view of oneDNN's packed fp32 weight buffer",
        py::arg("owner"), py::arg("ptr"), py::arg("panels"), py::arg("kp"));
  m.def("small_matmul", &small_matmul, "x @ W.T (+ bias): small batches of fp32 weights, any batch of half panels",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
  // the entry point for C++ callers (attention/csrc/decode_stack.h), named after its signature
  m.def("matmul_capsule", [] { return py::capsule(reinterpret_cast<void*>(&small_matmul), "forwardpass.dense_matmul"); });
}
