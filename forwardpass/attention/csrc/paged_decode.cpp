// Paged decode attention for CPUs: one query per sequence, keys and values read in place through the
// block table (no gather copy); scores, softmax, then P·V (three passes over a sequence's context).
//
// Reference semantics: forwardpass/attention/paged.py::paged_decode_attention (gather + SDPA) and,
// below it, the naive backend. tests/test_attention.py checks this kernel against the naive one.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                           torch::Tensor seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && kv_cache.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous(), "contiguous inputs required");
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t NB = kv_cache.size(1), BS = kv_cache.size(2), Hkv = kv_cache.size(3);
  const int64_t G = Hq / Hkv, max_blocks = block_tables.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = kv_cache.data_ptr<float>();
  const float* vp = kp + NB * BS * Hkv * D;
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  // Work item = one sequence: each K/V row (all KV heads of one position, contiguous) is streamed
  // once, front to back through each block, which keeps the hardware prefetcher busy. Splitting
  // by head instead read each row in pieces and ran latency-bound on a cold cache.
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;  // [Hq, n]: this sequence's scores, then probabilities
    for (int64_t b = begin; b < end; ++b) {
      const int64_t L = sl[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, L - window) : 0;
      const int64_t n = L - start;
      scores.resize(Hq * n);
      const float* qb = qp + b * Hq * D;
      // Pass 1: scores q·k for every visible key.
      for (int64_t t = start; t < L; ++t) {
        const int64_t blk = bt[b * max_blocks + t / BS];
        const float* krow = kp + (blk * BS + t % BS) * Hkv * D;
        for (int64_t hq = 0; hq < Hq; ++hq) {
          const float* qh = qb + hq * D;
          const float* kr = krow + (hq / G) * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qh[d] * kr[d];
          scores[hq * n + (t - start)] = dot * fscale;
        }
      }
      // Pass 2: softmax per query head; a contiguous loop so the exps vectorize.
      for (int64_t hq = 0; hq < Hq; ++hq) {
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
      // Pass 3: out = P·V.
      float* ob = op + b * Hq * D;
      std::fill(ob, ob + Hq * D, 0.f);
      for (int64_t t = start; t < L; ++t) {
        const int64_t blk = bt[b * max_blocks + t / BS];
        const float* vrow = vp + (blk * BS + t % BS) * Hkv * D;
        for (int64_t hq = 0; hq < Hq; ++hq) {
          const float p = scores[hq * n + (t - start)];
          const float* vr = vrow + (hq / G) * D;
          float* oh = ob + hq * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) oh[d] += p * vr[d];
        }
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode, "paged decode attention (CPU, fp32)"); }
