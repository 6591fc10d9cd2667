// Weight-only quantized matmul for AVX2/FMA CPUs: y[M, N] = x[M, K] · W[N, K]ᵀ with W stored in blocks of
// 32 weights along K, one fp16 scale per block (Q8_0: int8 values; Q4_0: 4-bit values q, weight = (q - 8) · d,
// the GGUF layouts, so a llama.cpp file's tensors are used as they are).
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
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t QK = 32;  // weights per block

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One row of activations → int8 blocks + fp32 scales. d = absmax / 127, q = round_half_even(x · (1 / d));
// the reference does exactly these float operations, so both produce the same bytes. The tail of the last
// block (K not a multiple of 32) is zero.
void quantize_row(const float* x, int64_t K, int64_t nb, int8_t* q, float* d) {
  alignas(32) float buf[QK];
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < nb; ++b) {
    const float* src = x + b * QK;
    const int64_t n = std::min<int64_t>(QK, K - b * QK);
    if (n < QK) {
      std::memset(buf, 0, sizeof(buf));
      std::memcpy(buf, src, n * sizeof(float));
      src = buf;
    }
    __m256 v0 = _mm256_loadu_ps(src), v1 = _mm256_loadu_ps(src + 8);
    __m256 v2 = _mm256_loadu_ps(src + 16), v3 = _mm256_loadu_ps(src + 24);
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                             _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
    __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float dd = amax / 127.0f;
    const float id = dd != 0.0f ? 1.0f / dd : 0.0f;
    d[b] = dd;
    const __m256 vid = _mm256_set1_ps(id);
    constexpr int R = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, vid), R));
    __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, vid), R));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, vid), R));
    __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, vid), R));
    i0 = _mm256_packs_epi32(i0, i1);
    i2 = _mm256_packs_epi32(i2, i3);
    i0 = _mm256_packs_epi16(i0, i2);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * QK), _mm256_permutevar8x32_epi32(i0, perm));
  }
}

// The 32 weights of block b of row `row` as int8 (Q8_0: as stored; Q4_0: nibbles unpacked, minus 8).
template <bool Q4>
inline __m256i load_block(const uint8_t* row, int64_t b) {
  if constexpr (Q4) {
    const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * QK / 2));
    const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
    return _mm256_sub_epi8(nib, _mm256_set1_epi8(8));
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * QK));
  }
}

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
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i xs[MR];
    float xds[MR];
    for (int i = 0; i < MR; ++i) {
      xs[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (m0 + i) * nb * QK + b * QK));
      xds[i] = xd[(m0 + i) * nb + b];
    }
    for (int j = 0; j < NR; ++j) {
      const __m256i w = load_block<Q4>(wq + (n0 + j) * w_stride, b);
      const __m256i wa = _mm256_sign_epi8(w, w);
      const float dw = _cvtsh_ss(wd[(n0 + j) * nb + b].x);  // F16C, not c10::Half's bit-twiddling
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

template <bool Q4>
torch::Tensor quant_matmul(torch::Tensor x, torch::Tensor wq, torch::Tensor wd) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "x must be a 2-D float32 tensor");
  TORCH_CHECK(wd.dtype() == torch::kFloat16 && wd.dim() == 2, "scales must be a 2-D float16 tensor");
  TORCH_CHECK(wq.dtype() == (Q4 ? torch::kUInt8 : torch::kInt8), Q4 ? "Q4_0 values must be uint8" : "Q8_0 values must be int8");
  x = x.contiguous();
  wq = wq.contiguous();
  wd = wd.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = wq.size(0), nb = wd.size(1);
  TORCH_CHECK(wd.size(0) == N && nb * QK >= K && (nb - 1) * QK < K, "scales do not match K=", K);
  const int64_t w_stride = Q4 ? nb * QK / 2 : nb * QK;
  TORCH_CHECK(wq.size(1) == w_stride, "packed weight row has ", wq.size(1), " bytes, expected ", w_stride);
  auto out = torch::empty({M, N}, x.options());
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
  // Each thread takes a contiguous range of output rows (weights are read once in total). Within it, a
  // tile of 16 weight rows (≤ 48 KB at K = 3072, in L2) is reused by every group of 4 activation rows.
  constexpr int64_t NT = 16;
  at::parallel_for(0, (N + NT - 1) / NT, 1, [&](int64_t t_begin, int64_t t_end) {
    for (int64_t t = t_begin; t < t_end; ++t) {
      const int64_t n0 = t * NT, n1 = std::min(N, n0 + NT);
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) rows<Q4, 4>(wqp, w_stride, wdp, nb, xqp, xdp, m, n0, n1, N, op);
      switch (M - m) {
        case 3: rows<Q4, 3>(wqp, w_stride, wdp, nb, xqp, xdp, m, n0, n1, N, op); break;
        case 2: rows<Q4, 2>(wqp, w_stride, wdp, nb, xqp, xdp, m, n0, n1, N, op); break;
        case 1: rows<Q4, 1>(wqp, w_stride, wdp, nb, xqp, xdp, m, n0, n1, N, op); break;
        default: break;
      }
    }
  });
  return out;
}

// Weights back to fp32 [N, K] (w = q · d, one float multiply per weight: bitwise formats.dequantize). For large
// batches (prefill chunks) a float GEMM on the dequantized rows beats the int8 dot products (see weight.py).
template <bool Q4>
torch::Tensor dequantize(torch::Tensor wq, torch::Tensor wd, int64_t K) {
  wq = wq.contiguous();
  wd = wd.contiguous();
  const int64_t N = wq.size(0), nb = wd.size(1);
  TORCH_CHECK(nb * QK >= K && (nb - 1) * QK < K, "scales do not match K=", K);
  const int64_t w_stride = Q4 ? nb * QK / 2 : nb * QK;
  auto out = torch::empty({N, K}, torch::dtype(torch::kFloat32));
  const uint8_t* wqp = reinterpret_cast<const uint8_t*>(wq.data_ptr());
  const at::Half* wdp = wd.data_ptr<at::Half>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    alignas(32) float buf[QK];
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t b = 0; b < nb; ++b) {
        const __m256i w = load_block<Q4>(wqp + n * w_stride, b);
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(wdp[n * nb + b].x));
        const int64_t len = std::min<int64_t>(QK, K - b * QK);
        float* dst = len == QK ? op + n * K + b * QK : buf;
        const __m128i lo = _mm256_castsi256_si128(w), hi = _mm256_extracti128_si256(w, 1);
        _mm256_storeu_ps(dst, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), d));
        _mm256_storeu_ps(dst + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), d));
        _mm256_storeu_ps(dst + 16, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), d));
        _mm256_storeu_ps(dst + 24, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), d));
        if (len < QK) std::memcpy(op + n * K + b * QK, buf, len * sizeof(float));
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
  m.def("q8_0_dequantize", &dequantize<false>, "Q8_0 (values, scales, K) → fp32 [N, K]");
  m.def("q4_0_dequantize", &dequantize<true>, "Q4_0 (values, scales, K) → fp32 [N, K]");
  m.def("quantize_activations", &quantize_activations, "x[M,K] fp32 → (int8 [M,Kp], fp32 scales [M,Kp/32])");
}
