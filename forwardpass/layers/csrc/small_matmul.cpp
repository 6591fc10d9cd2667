// fp32 matmul for small batches (decode steps): y[M, N] = x[M, K] · W[N, K]ᵀ (+ bias), W in its checkpoint
// layout (row n holds output n's K weights contiguously), nothing packed, nothing copied.
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
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

#if defined(__AVX512F__)
struct Vec {
  using T = __m512;
  static constexpr int64_t L = 16;
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
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

// Rows m..m+MR of x against weight rows n..n+NRB: the register block.
template <int MR, int NRB>
inline void block(const float* x, int64_t K, const float* w, int64_t m, int64_t n, const float* bias, float* y,
                  int64_t N) {
  typename Vec::T acc[MR][NRB];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NRB; ++j) acc[i][j] = Vec::zero();
  const float* xr[MR];
  const float* wr[NRB];
  for (int i = 0; i < MR; ++i) xr[i] = x + (m + i) * K;
  for (int j = 0; j < NRB; ++j) wr[j] = w + (n + j) * K;
  const int64_t kv = K / Vec::L * Vec::L;
  for (int64_t k = 0; k < kv; k += Vec::L) {
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

template <int MR>
inline void rows(const float* x, int64_t K, const float* w, int64_t m, int64_t n0, int64_t n1, const float* bias,
                 float* y, int64_t N) {
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) block<MR, NR>(x, K, w, m, n, bias, y, N);
  switch (n1 - n) {
    case 3: block<MR, 3>(x, K, w, m, n, bias, y, N); break;
    case 2: block<MR, 2>(x, K, w, m, n, bias, y, N); break;
    case 1: block<MR, 1>(x, K, w, m, n, bias, y, N); break;
    default: break;
  }
}

}  // namespace

torch::Tensor small_matmul(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K] and W [N, K] expected");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  torch::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.dtype() == torch::kFloat32 && b.numel() == N, "bias: [N] float32");
  }
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (N + NT - 1) / NT, 1, [&](int64_t t_begin, int64_t t_end) {
    for (int64_t t = t_begin; t < t_end; ++t) {
      const int64_t n0 = t * NT, n1 = std::min(N, n0 + NT);
      int64_t m = 0;
      for (; m + MR_MAX <= M; m += MR_MAX) rows<MR_MAX>(xp, K, wp, m, n0, n1, bp, yp, N);
      if constexpr (MR_MAX > 3) {
        if (M - m == 3) rows<3>(xp, K, wp, m, n0, n1, bp, yp, N);
      }
      if constexpr (MR_MAX > 2) {
        if (M - m == 2) rows<2>(xp, K, wp, m, n0, n1, bp, yp, N);
      }
      if (M - m == 1) rows<1>(xp, K, wp, m, n0, n1, bp, yp, N);
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_matmul", &small_matmul, "x @ W.T (+ bias) for small batches (CPU, fp32)", py::arg("x"),
        py::arg("w"), py::arg("bias") = py::none());
}
