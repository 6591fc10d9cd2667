// Paged decode attention for CPUs: one query per sequence, keys and values read in place through the
// block table (no gather copy); scores, softmax, then P·V (three passes over a sequence's context).
//
// Reference semantics: forwardpass/attention/paged.py::paged_decode_attention (gather + SDPA) and,
// below it, the naive backend. tests/test_attention.py checks this kernel against the naive one.
//
// Also here, the small per-layer operations of a decode step fused into one call each (rms_norm, and
// q/k-norm + rotary in place on the qkv projection, SwiGLU, the K/V store): at batch 1 they touch a few KB, and as chains of 5-8
// torch ops they cost 30-55 us each in dispatch, ~8 ms of a 0.6B model's token.
// References: forwardpass/layers/norm.py::RMSNorm, forwardpass/layers/rotary.py::apply_rotary.
#include "torch_ext.h"  // forwardpass/csrc/: torch/extension.h less the C++ frontend
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// lane j = the sum of a[j]'s 8 lanes: 8 horizontal sums in 6 hadds, 2 lane swaps and an add
inline __m256 sum8x8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// 8 cache values as floats: an fp32 cache as is, an fp16 cache converted in registers (F16C, exact), a bf16 cache
// widened in registers (its 16 bits are a float's upper half: exact)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const at::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// Scores of query head qh against the keys at rows[0..cnt) + head (cnt <= 8): 8 independent FMA chains, one
// per position, then one 8-way reduction instead of 8 horizontal sums.
template <typename T>
inline void scores8(const float* qh, const T* const* rows, int64_t head, int cnt, int64_t D, float scale,
                    float* dst) {
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(qh + d);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, load8(rows[j] + head + d), acc[j]);
  }
  alignas(32) float out[8];
  _mm256_store_ps(out, _mm256_mul_ps(sum8x8(acc), _mm256_set1_ps(scale)));
  for (int j = 0; j < cnt; ++j) dst[j] = out[j];
}

// out[0..8·NV) += Σ_i p[i] · rows[i][off .. off + 8·NV) over n positions, the NV accumulators in registers
// (NV is a compile-time constant: with a run-time count the compiler kept them on the stack, and every FMA
// waited on a store and a reload: measured, half of the kernel's time).
template <int NV, typename T>
inline void weighted_sum_cols(const float* p, const T* const* rows, int64_t off, int64_t n, float* out) {
  __m256 o[NV];
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) o[v] = _mm256_loadu_ps(out + 8 * v);
  for (int64_t i = 0; i < n; ++i) {
    const __m256 pv = _mm256_set1_ps(p[i]);
    const T* r = rows[i] + off;
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) o[v] = _mm256_fmadd_ps(pv, load8(r + 8 * v), o[v]);
  }
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) _mm256_storeu_ps(out + 8 * v, o[v]);
}

// out[0..D) += Σ_i p[i] · (rows[i] + head)[0..D) over n positions, 64 columns at a time (D % 8 == 0).
template <typename T>
inline void weighted_sum(const float* p, const T* const* rows, int64_t head, int64_t n, int64_t D,
                         float* out) {
  int64_t c = 0;
  for (; c + 64 <= D; c += 64) weighted_sum_cols<8, T>(p, rows, head + c, n, out + c);
  switch ((D - c) / 8) {
    case 7: weighted_sum_cols<7, T>(p, rows, head + c, n, out + c); break;
    case 6: weighted_sum_cols<6, T>(p, rows, head + c, n, out + c); break;
    case 5: weighted_sum_cols<5, T>(p, rows, head + c, n, out + c); break;
    case 4: weighted_sum_cols<4, T>(p, rows, head + c, n, out + c); break;
    case 3: weighted_sum_cols<3, T>(p, rows, head + c, n, out + c); break;
    case 2: weighted_sum_cols<2, T>(p, rows, head + c, n, out + c); break;
    case 1: weighted_sum_cols<1, T>(p, rows, head + c, n, out + c); break;
    default: break;
  }
}

// Positions ahead of the ones being computed whose K (pass 1) or V (pass 3) rows are prefetched into L2. Each pass
// walks 8 rows at a time head by head (a head's slice of 8 rows, then the next head's), an order the hardware
// prefetchers did not run ahead of: with the cache in DRAM (a decode step's weights evict it between layers)
// the loads waited on memory, ~7 GB/s of cache per core against ~30 for a plain stream. Measured at batch 64,
// one core: 16 positions ahead into L2 1.5x faster; into L1, or 48 and more ahead, no better than none.
constexpr int64_t kPrefetchAhead = 16;

// Into L2: columns [off, off + len) of rows[i0 .. i1), each row's cache lines front to back.
template <typename T>
inline void prefetch_rows(const T* const* rows, int64_t i0, int64_t i1, int64_t off, int64_t len) {
  for (int64_t i = i0; i < i1; ++i) {
    const uintptr_t first = reinterpret_cast<uintptr_t>(rows[i] + off) & ~uintptr_t{63};
    const uintptr_t end = reinterpret_cast<uintptr_t>(rows[i] + off + len);
    for (uintptr_t line = first; line < end; line += 64) _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T1);
  }
}

}  // namespace

namespace {

template <typename T>  // the cache's element type: float, at::Half or at::BFloat16
torch::Tensor paged_decode_impl(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                                torch::Tensor seq_lens, double scale, int64_t window) {
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t NB = kv_cache.size(1), BS = kv_cache.size(2), Hkv = kv_cache.size(3);
  const int64_t G = Hq / Hkv, max_blocks = block_tables.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const T* kp = kv_cache.data_ptr<T>();
  const T* vp = kp + NB * BS * Hkv * D;
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const bool vectorized = D % 8 == 0;  // else the plain loops below (the compiler vectorizes what it can)

  // Work item = one sequence, or, when there are fewer sequences than threads (batch 1 would otherwise leave
  // all but one core idle), one sequence and a contiguous range of KV heads. A head's computation is the same
  // either way, so results do not depend on the batch.
  const int64_t splits = B >= at::get_num_threads() ? 1 : std::min<int64_t>(Hkv, at::get_num_threads());
  at::parallel_for(0, B * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;        // [Hq, n]: this sequence's scores, then probabilities
    std::vector<int64_t> row_offset;  // [n]: where each visible position's K/V row starts in its cache half
    std::vector<const T*> rows;       // [n + 8]: those rows (K in pass 1, V in pass 3), padded to a multiple of 8
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / splits, part = item % splits;
      const int64_t h0 = Hkv * part / splits * G, h1 = Hkv * (part + 1) / splits * G;  // query heads
      const int64_t L = sl[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, L - window) : 0;
      const int64_t n = L - start;
      scores.resize(Hq * n);
      row_offset.resize(n);
      rows.resize(n + 8);
      for (int64_t t = start; t < L; ++t)
        row_offset[t - start] = (bt[b * max_blocks + t / BS] * BS + t % BS) * Hkv * D;
      const float* qb = qp + b * Hq * D;
      float* ob = op + b * Hq * D;
      // Pass 1: scores q·k for every visible key, 8 positions at a time, query head by query head (a head reads its
      // KV head's slice of the 8 rows, so each row is fetched from memory once and serves every query head; the
      // rows further on are prefetched meanwhile). Pass 2: softmax per query head (a contiguous loop, so the exps
      // vectorize). Pass 3: out = P·V, in the same order.
      const int64_t col0 = (h0 / G) * D, cols = (h1 - h0) / G * D;  // this item's KV heads in a row
      if (vectorized) {
        for (int64_t i = 0; i < n; ++i) rows[i] = kp + row_offset[i];
        for (int64_t i = n; i < n + 8; ++i) rows[i] = rows[0];  // padding for the last group of 8
        prefetch_rows(rows.data(), 0, std::min(n, kPrefetchAhead), col0, cols);
        for (int64_t i = 0; i < n; i += 8) {
          prefetch_rows(rows.data(), std::min(n, i + kPrefetchAhead), std::min(n, i + kPrefetchAhead + 8), col0, cols);
          const int cnt = static_cast<int>(std::min<int64_t>(8, n - i));
          for (int64_t hq = h0; hq < h1; ++hq)
            scores8(qb + hq * D, rows.data() + i, (hq / G) * D, cnt, D, fscale, scores.data() + hq * n + i);
        }
      } else {
        for (int64_t i = 0; i < n; ++i)
          for (int64_t hq = h0; hq < h1; ++hq) {
            const float* qh = qb + hq * D;
            const T* kr = kp + row_offset[i] + (hq / G) * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qh[d] * static_cast<float>(kr[d]);
            scores[hq * n + i] = dot * fscale;
          }
      }
      if (vectorized) {  // pass 3's rows, the first of them on their way during the softmax
        for (int64_t i = 0; i < n; ++i) rows[i] = vp + row_offset[i];
        prefetch_rows(rows.data(), 0, std::min(n, kPrefetchAhead), col0, cols);
      }
      for (int64_t hq = h0; hq < h1; ++hq) {
        float* sh = scores.data() + hq * n;
        float mx = sh[0];
        for (int64_t j = 1; j < n; ++j) mx = std::max(mx, sh[j]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; ++j) {
          sh[j] = std::exp(sh[j] - mx);
          sum += sh[j];
        }
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < n; ++j) sh[j] *= inv;
      }
      std::fill(ob + h0 * D, ob + h1 * D, 0.f);
      if (vectorized) {
        for (int64_t i = 0; i < n; i += 8) {
          prefetch_rows(rows.data(), std::min(n, i + kPrefetchAhead), std::min(n, i + kPrefetchAhead + 8), col0, cols);
          const int64_t cnt = std::min<int64_t>(8, n - i);
          for (int64_t hq = h0; hq < h1; ++hq)
            weighted_sum(scores.data() + hq * n + i, rows.data() + i, (hq / G) * D, cnt, D, ob + hq * D);
        }
      } else {
        for (int64_t i = 0; i < n; ++i)
          for (int64_t hq = h0; hq < h1; ++hq) {
            const float p = scores[hq * n + i];
            const T* vr = vp + row_offset[i] + (hq / G) * D;
            float* oh = ob + hq * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) oh[d] += p * static_cast<float>(vr[d]);
          }
      }
    }
  });
  return out;
}

}  // namespace

// The cache may be fp32, fp16 or bf16 (kv_cache_dtype: values converted to fp32 as they are read); q, the scores
// and the output are fp32.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                           torch::Tensor seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dtype() == torch::kFloat32, "q: float32 only");
  TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous(), "contiguous inputs required");
  if (kv_cache.dtype() == torch::kHalf) return paged_decode_impl<at::Half>(q, kv_cache, block_tables, seq_lens, scale, window);
  if (kv_cache.dtype() == torch::kBFloat16)
    return paged_decode_impl<at::BFloat16>(q, kv_cache, block_tables, seq_lens, scale, window);
  TORCH_CHECK(kv_cache.dtype() == torch::kFloat32, "KV cache: float32, float16 or bfloat16 only");
  return paged_decode_impl<float>(q, kv_cache, block_tables, seq_lens, scale, window);
}

namespace {

// RMSNorm of one row in place from src to dst, the reference's order of operations: x · rsqrt(mean(x²) + eps),
// then · weight. The mean's summation order differs from torch's (a few ulp).
inline void norm_row(const float* src, float* dst, const float* w, int64_t D, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t d = 0; d < D; ++d) ss += src[d] * src[d];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) dst[d] = w[d] * (src[d] * r);
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32, "float32 only");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t D = w.numel();
  TORCH_CHECK(x.size(-1) == D, "last dimension ", x.size(-1), " != weight size ", D);
  auto out = torch::empty_like(x);
  const int64_t rows = D ? x.numel() / D : 0;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * D, op + r * D, wp, D, static_cast<float>(eps));
  });
  return out;
}

// In place on the qkv projection [T, W] (W ≥ (Hq + Hkv)·D, q heads then k heads first): optional per-head
// RMSNorm of q (weight qw) and k (weight kw), then rotary with the rotate-half layout:
// out[i] = x[i]·cos[i] + (-x[i + D/2])·sin[i] for i < D/2, x[i]·cos[i] + x[i - D/2]·sin[i] above.
void qk_norm_rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t Hq, int64_t Hkv, int64_t D,
                   c10::optional<torch::Tensor> qw, c10::optional<torch::Tensor> kw, double eps) {
  TORCH_CHECK(qkv.dtype() == torch::kFloat32 && qkv.is_contiguous() && qkv.dim() == 2, "qkv: 2-D contiguous fp32");
  TORCH_CHECK(D % 2 == 0 && qkv.size(1) >= (Hq + Hkv) * D, "qkv is narrower than its q and k heads");
  cos = cos.contiguous();
  sin = sin.contiguous();
  TORCH_CHECK(cos.size(0) == qkv.size(0) && cos.size(1) == D && sin.sizes() == cos.sizes(), "cos/sin: [T, D]");
  const bool norm = qw.has_value();
  TORCH_CHECK(norm == kw.has_value(), "q and k norms come together");
  torch::Tensor qwc = norm ? qw->contiguous() : torch::Tensor(), kwc = norm ? kw->contiguous() : torch::Tensor();
  const float* qwp = norm ? qwc.data_ptr<float>() : nullptr;
  const float* kwp = norm ? kwc.data_ptr<float>() : nullptr;
  const int64_t T = qkv.size(0), W = qkv.size(1), half = D / 2;
  float* base = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, T * (Hq + Hkv), 64, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / (Hq + Hkv), h = item % (Hq + Hkv);
      float* x = base + t * W + h * D;
      if (norm) norm_row(x, tmp.data(), h < Hq ? qwp : kwp, D, static_cast<float>(eps));
      else std::copy(x, x + D, tmp.data());
      const float* c = cp + t * D;
      const float* s = sp + t * D;
      for (int64_t i = 0; i < half; ++i) x[i] = tmp[i] * c[i] + (-tmp[i + half]) * s[i];
      for (int64_t i = half; i < D; ++i) x[i] = tmp[i] * c[i] + tmp[i - half] * s[i];
    }
  });
}

// SwiGLU on [..., 2F] (gate then up in each row) → [..., F]: silu(gate) · up. ATen's own vectorised silu and
// mul, called from here: one Python-level call instead of three (chunk, silu, mul), same float results.
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dtype() == torch::kFloat32 && gate_up.size(-1) % 2 == 0, "float32 [..., 2F] only");
  const int64_t F = gate_up.size(-1) / 2;
  return at::silu(gate_up.narrow(-1, 0, F)).mul_(gate_up.narrow(-1, F, F));
}

// This step's keys and values [T, Hkv, D] (any row strides: they are views of the qkv projection) into the
// cache [2, blocks, block_size, Hkv, D] at flat slots slot_mapping [T]. Reference: paged.py::write_kv.
namespace {

// fp32 → the cache's type; to fp16 with F16C's round-to-nearest-even, as torch's .to(torch.float16)
inline void copy_row(const float* src, int64_t n, float* dst) { std::copy_n(src, n, dst); }
inline void copy_row(const float* src, int64_t n, at::Half* dst) {
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), kRound));
  for (; i < n; ++i) dst[i].x = _cvtss_sh(src[i], kRound);
}
// to bf16 with c10::BFloat16's round-to-nearest-even, as torch's .to(torch.bfloat16)
inline void copy_row(const float* src, int64_t n, at::BFloat16* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::BFloat16(src[i]);
}

template <typename T>
void write_kv_impl(torch::Tensor kv_cache, const torch::Tensor& k, const torch::Tensor& v, const int64_t* sp) {
  const int64_t T_ = k.size(0), H = k.size(1), D = k.size(2);
  const int64_t slots = kv_cache.size(1) * kv_cache.size(2);
  T* kc = kv_cache.data_ptr<T>();
  T* vc = kc + slots * H * D;
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  for (int64_t t = 0; t < T_; ++t)
    for (int64_t h = 0; h < H; ++h) {
      copy_row(kp + t * k.stride(0) + h * k.stride(1), D, kc + (sp[t] * H + h) * D);
      copy_row(vp + t * v.stride(0) + h * v.stride(1), D, vc + (sp[t] * H + h) * D);
    }
}

}  // namespace

void write_kv_(torch::Tensor kv_cache, torch::Tensor k, torch::Tensor v, torch::Tensor slot_mapping) {
  TORCH_CHECK((kv_cache.dtype() == torch::kFloat32 || kv_cache.dtype() == torch::kHalf ||
               kv_cache.dtype() == torch::kBFloat16) && kv_cache.is_contiguous(),
              "contiguous float32, float16 or bfloat16 cache");
  TORCH_CHECK(k.dtype() == torch::kFloat32 && v.dtype() == torch::kFloat32 && k.sizes() == v.sizes() && k.dim() == 3,
              "k, v: [T, Hkv, D] float32");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k, v: unit stride along D");
  slot_mapping = slot_mapping.to(torch::kInt64).contiguous();
  const int64_t T = k.size(0), H = k.size(1), D = k.size(2);
  const int64_t slots = kv_cache.size(1) * kv_cache.size(2);
  TORCH_CHECK(kv_cache.size(3) == H && kv_cache.size(4) == D && slot_mapping.numel() == T, "shapes do not match");
  const int64_t* sp = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < slots, "slot ", sp[t], " out of range");
  if (kv_cache.dtype() == torch::kHalf) write_kv_impl<at::Half>(kv_cache, k, v, sp);
  else if (kv_cache.dtype() == torch::kBFloat16) write_kv_impl<at::BFloat16>(kv_cache, k, v, sp);
  else write_kv_impl<float>(kv_cache, k, v, sp);
}

#include "decode_stack.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("silu_and_mul", &silu_and_mul, "SwiGLU: silu(gate) * up over [..., 2F] (CPU, fp32)");
  m.def("write_kv_", &write_kv_, "store this step's K/V at their cache slots (CPU, fp32)");
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU, fp32)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension (CPU, fp32)");
  m.def("qk_norm_rope_", &qk_norm_rope_, "per-head q/k RMSNorm + rotary, in place on qkv (CPU, fp32)");
  decode_stack::bind(m);  // a decode step's layers in one call (decode_stack.h)
}
