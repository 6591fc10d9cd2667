// The GGUF types beyond Q8_0/Q4_0 (Q4_1, Q5_0, Q5_1 and the K-quants Q2_K..Q6_K), multiplied from their codes and
// scales as the file stores them, repacked without rounding (forwardpass/quant/kblocks.py):
//
//   codes [N, nb·BB] uint8: per block of 32 weights 16 bytes of nibbles (byte j: element j low, j + 16 high) and, for
//     6-bit codes, 8 bytes of the two high bits (byte j: elements j, j+8, j+16, j+24 at bits 0-1, 2-3, 4-5, 6-7);
//   meta [N, row bytes] uint8: fp16 d (per block, or per super-block of 8 blocks), fp16 dmin where the type has mins,
//     then for K-quants the int8 scale of each group of G weights and the int8 min factor of each group.
//
// weight = (d · sc) · (u - OFF) + dmin (Q4_1, Q5_1) or - dmin · mc (K-quants), u the unsigned code. With activations quantized to int8 per block of 32
// (quantize_row, llama.cpp's recipe), a block's contribution is
//   Σ_lanes float(Σ4 u·xq) · (d·sc·dx) + xl · (min - OFF·d·sc),   xl = dx · Σ4 xq (per lane of 4 activations)
// i.e. one unsigned × signed int8 dot product (maddubs; vpdpbusd where the build has AVX-512 VNNI) and two FMAs per
// block and weight row: the min and the code offset ride on the activations' lane sums, computed once per row.
// A lane is 4 consecutive weights, so a group of 16 (Q2_K, Q3_K, Q6_K) is lanes 0-3 or 4-7 of its block.
//
// Reference: forwardpass/quant/kblocks.py (reference_matmul: the dequantized int8 activations times the dequantized
// weights in fp32; they differ in float rounding only). Threads: at::parallel_for over tiles of 16 weight rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <cstring>

#include "activations.h"

namespace {

std::atomic<int64_t> g_calls{0};  // matmuls run (tests assert that this kernel, not a fallback, computed)

// A type's layout: BITS 4 or 6, SB blocks of 32 per d (1 or 8), G weights per scale (16 or 32), mins, code offset.
template <int BITS_, int SB_, int G_, bool MIN_, int OFF_>
struct Kind {
  static constexpr int BITS = BITS_, SB = SB_, G = G_, OFF = OFF_;
  static constexpr bool MIN = MIN_;
  static constexpr int BB = BITS == 6 ? 24 : 16;  // code bytes per block of 32
  static constexpr int GPB = 32 / G;               // groups per block
  // meta bytes of a row of nb blocks (kblocks.py::meta_bytes)
  static int64_t meta_bytes(int64_t nb) {
    const int64_t nd = nb / SB;
    int64_t bytes = nd * 2 * (MIN ? 2 : 1);
    if (SB > 1) bytes += nb * GPB * (MIN ? 2 : 1);
    return (bytes + 3) / 4 * 4;
  }
};

using Q4_1 = Kind<4, 1, 32, true, 0>;
using Q5_0 = Kind<6, 1, 32, false, 16>;
using Q5_1 = Kind<6, 1, 32, true, 0>;
using Q2_K = Kind<4, 8, 16, true, 0>;
using Q3_K = Kind<4, 8, 16, false, 4>;
using Q4_K = Kind<4, 8, 32, true, 0>;
using Q5_K = Kind<6, 8, 32, true, 0>;
using Q6_K = Kind<6, 8, 16, false, 32>;

// The 32 unsigned codes of a block as bytes.
template <int BITS>
inline __m256i load_codes(const uint8_t* blk) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk));
  __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
  if constexpr (BITS == 6) {
    int64_t h;
    std::memcpy(&h, blk + 16, 8);
    // 64-bit lane e holds elements 8e..8e+7: their high bits are bits 2e, 2e+1 of the plane's bytes
    __m256i hv = _mm256_srlv_epi64(_mm256_set1_epi64x(h), _mm256_setr_epi64x(0, 2, 4, 6));
    hv = _mm256_and_si256(hv, _mm256_set1_epi8(0x03));
    u = _mm256_or_si256(u, _mm256_slli_epi16(hv, 4));  // bytes <= 3 << 4: no bit crosses into the next byte
  }
  return u;
}

// Σ of each lane's 4 products u · x (u unsigned <= 63, x int8: no int16 saturation in maddubs)
inline __m256i dot_lanes(__m256i u, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
#endif
}

// The scale of each lane (d·sc) and its min for block b of a row: `offset_min` gives the kernel's form (the signed min
// with -OFF·scale folded in), else the dequantizer's (dmin·mc, to subtract for K-quants, ggml's operations exactly).
template <class K>
inline void block_scales(const uint8_t* meta, int64_t nb, int64_t b, bool offset_min, __m256& sv, __m256& mv) {
  const auto* d16 = reinterpret_cast<const uint16_t*>(meta);
  const int64_t nd = nb / K::SB, sb = b / K::SB;
  const float d = _cvtsh_ss(d16[sb]);
  float s0 = d, s1 = d, m0 = 0.0f, m1 = 0.0f;
  const int8_t* sc = reinterpret_cast<const int8_t*>(meta + nd * 2 * (K::MIN ? 2 : 1));
  if constexpr (K::SB > 1) {
    s0 = d * static_cast<float>(sc[b * K::GPB]);
    s1 = K::GPB == 2 ? d * static_cast<float>(sc[b * K::GPB + 1]) : s0;
  }
  if constexpr (K::MIN) {
    const float dm = _cvtsh_ss(d16[nd + sb]);
    m0 = m1 = dm;
    if constexpr (K::SB > 1) {
      const int8_t* mc = sc + nb * K::GPB;
      m0 = dm * static_cast<float>(mc[b * K::GPB]);
      m1 = K::GPB == 2 ? dm * static_cast<float>(mc[b * K::GPB + 1]) : m0;
    }
  }
  if (offset_min) {  // OFF · scale is exact (a scale has <= 19 significant bits, OFF <= 32)
    if constexpr (K::SB > 1 && K::MIN) {
      m0 = -m0;
      m1 = -m1;
    }
    m0 -= K::OFF * s0;
    m1 -= K::OFF * s1;
  }
  sv = _mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0));
  mv = _mm256_set_m128(_mm_set1_ps(m1), _mm_set1_ps(m0));
}

struct Acts {
  const int8_t* xq;     // [M, nb·32]
  const float* xd;      // [M, nb]
  const float* xl;      // [M, nb·8]: dx · (Σ of each lane's 4 activations)
  const float* quads;   // [M, nq·16] per quad of blocks: dx of its 4 blocks twice, then dx · each group's sum
  int64_t nb, nq;
};

struct Rows {
  const uint8_t* codes;
  int64_t cstride;
  const uint8_t* meta;
  int64_t mstride;
};

// The scales and kernel-form mins of 4 blocks b0..b0+3 of a row, as [group 0 of b0..b3 | group 1 of b0..b3] (for
// 32-weight groups both halves are the same): the order the lane sums of 4 blocks take after two hadds (quad_sums).
template <class K>
inline void quad_scales(const uint8_t* meta, int64_t nb, int64_t b0, __m256& s8, __m256& m8) {
  const auto* d16 = reinterpret_cast<const uint16_t*>(meta);
  const int64_t nd = nb / K::SB;
  m8 = _mm256_setzero_ps();
  if constexpr (K::SB == 1) {
    const __m128 d4 = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(d16 + b0)));
    s8 = _mm256_set_m128(d4, d4);
    if constexpr (K::MIN) {
      const __m128 m4 = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(d16 + nd + b0)));
      m8 = _mm256_set_m128(m4, m4);
    }
  } else {
    const int8_t* sc = reinterpret_cast<const int8_t*>(meta + nd * 2 * (K::MIN ? 2 : 1));
    const int8_t* mc = sc + nb * K::GPB;
    const int64_t sb = b0 / K::SB;
    auto factors = [&](const int8_t* f) {  // the 4 blocks' int8 factors, in quad order, as floats
      if constexpr (K::GPB == 1) {
        int32_t four;
        std::memcpy(&four, f + b0, 4);
        const __m128 c = _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(four)));
        return _mm256_set_m128(c, c);
      } else {
        const __m256i c = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(f + 2 * b0)));
        return _mm256_cvtepi32_ps(_mm256_permutevar8x32_epi32(c, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7)));
      }
    };
    s8 = _mm256_mul_ps(factors(sc), _mm256_set1_ps(_cvtsh_ss(d16[sb])));
    if constexpr (K::MIN)  // K-quants subtract their mins
      m8 = _mm256_mul_ps(factors(mc), _mm256_set1_ps(-_cvtsh_ss(d16[nd + sb])));
  }
  if constexpr (K::OFF != 0) m8 = _mm256_fnmadd_ps(s8, _mm256_set1_ps(static_cast<float>(K::OFF)), m8);
}

// two hadds: the lane sums of 4 blocks → [group 0 of each | group 1 of each] (lanes 0-3 of a block are its weights
// 0-15, lanes 4-7 its 16-31)
inline __m256i quad_sums(__m256i v0, __m256i v1, __m256i v2, __m256i v3) {
  return _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
}

template <class K, int MR, int NR>
void micro(const Rows& w, const Acts& a, int64_t m0, int64_t n0, int64_t N, float* out) {
  constexpr bool ADD_MIN = K::MIN || K::OFF != 0;
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t nb = a.nb, nq = nb / 4;
  // whole quads of blocks: 4 dot products, their lane sums reduced to group sums, one FMA for scales and one for mins
  for (int64_t q = 0; q < nq; ++q) {
    const int64_t b0 = 4 * q;
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      const uint8_t* row = w.codes + (n0 + j) * w.cstride + b0 * K::BB;
      const __m256i u0 = load_codes<K::BITS>(row), u1 = load_codes<K::BITS>(row + K::BB);
      const __m256i u2 = load_codes<K::BITS>(row + 2 * K::BB), u3 = load_codes<K::BITS>(row + 3 * K::BB);
      __m256 s8, m8;
      quad_scales<K>(w.meta + (n0 + j) * w.mstride, nb, b0, s8, m8);
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) {
        const int8_t* xq = a.xq + (m0 + i) * nb * QK + b0 * QK;
        auto x = [&](int k) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + k * QK)); };
        const __m256i sums = quad_sums(dot_lanes(u0, x(0)), dot_lanes(u1, x(1)), dot_lanes(u2, x(2)),
                                       dot_lanes(u3, x(3)));
        const float* act = a.quads + ((m0 + i) * a.nq + q) * 16;  // [dx ×2 | dx · group sums] of the quad
        acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(s8, _mm256_loadu_ps(act)), acc[i][j]);
        if constexpr (ADD_MIN) acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(act + 8), m8, acc[i][j]);
      }
    }
  }
  // the 1-3 blocks left: one at a time, each lane with its scale
  for (int64_t b = 4 * nq; b < nb; ++b) {
    for (int j = 0; j < NR; ++j) {
      const __m256i u = load_codes<K::BITS>(w.codes + (n0 + j) * w.cstride + b * K::BB);
      __m256 sv, mv;
      block_scales<K>(w.meta + (n0 + j) * w.mstride, nb, b, true, sv, mv);
      for (int i = 0; i < MR; ++i) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.xq + (m0 + i) * nb * QK + b * QK));
        const __m256 lanes = _mm256_cvtepi32_ps(dot_lanes(u, x));
        acc[i][j] = _mm256_fmadd_ps(lanes, _mm256_mul_ps(sv, _mm256_set1_ps(a.xd[(m0 + i) * nb + b])), acc[i][j]);
        if constexpr (ADD_MIN)
          acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(a.xl + ((m0 + i) * nb + b) * 8), mv, acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) out[(m0 + i) * N + n0 + j] = hsum(acc[i][j]);
}

// activation rows m..m+MR against weight rows n0..n1 (a 16-row tile): 4 weight rows at a time for one activation
// row (independent FMA chains), fewer as more activation rows share each loaded block (16 ymm registers)
template <class K, int MR>
void tile_rows(const Rows& w, const Acts& a, int64_t m, int64_t n0, int64_t n1, int64_t N, float* out) {
  constexpr int NR = MR == 1 ? 4 : MR == 2 ? 2 : 1;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) micro<K, MR, NR>(w, a, m, n, N, out);
  for (; n < n1; ++n) micro<K, MR, 1>(w, a, m, n, N, out);
}

template <class K>
void check(const torch::Tensor& codes, const torch::Tensor& meta, int64_t& nb) {
  TORCH_CHECK(codes.dtype() == torch::kUInt8 && codes.dim() == 2 && codes.is_contiguous(), "codes: uint8 [N, bytes]");
  TORCH_CHECK(meta.dtype() == torch::kUInt8 && meta.dim() == 2 && meta.is_contiguous(), "meta: uint8 [N, bytes]");
  TORCH_CHECK(codes.size(1) % K::BB == 0, "a code row of ", codes.size(1), " bytes is not whole blocks");
  nb = codes.size(1) / K::BB;
  TORCH_CHECK(nb % K::SB == 0 && meta.size(0) == codes.size(0) && meta.size(1) == K::meta_bytes(nb),
              "meta does not match ", nb, " blocks per row");
}

template <class K>
torch::Tensor matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor meta) {
  int64_t nb = 0;
  check<K>(codes, meta, nb);
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == nb * QK, "x must be float32 [M, ", nb * QK,
              "]");
  x = x.contiguous();
  g_calls.fetch_add(1, std::memory_order_relaxed);
  const int64_t M = x.size(0), N = codes.size(0), K_ = nb * QK;
  auto xq = torch::empty({M, K_}, x.options().dtype(torch::kInt8));
  auto xd = torch::empty({M, nb}, x.options());
  auto xl = torch::empty({M, nb * 8}, x.options());
  const int64_t nq = nb / 4;
  auto xquads = torch::empty({M, std::max<int64_t>(nq, 1) * 16}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* xqp = xq.data_ptr<int8_t>();
  float* xdp = xd.data_ptr<float>();
  float* xlp = xl.data_ptr<float>();
  float* xqd = xquads.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      quantize_row(xp + m * K_, K_, nb, xqp + m * K_, xdp + m * nb);
      for (int64_t b = 0; b < nb; ++b) {  // each lane's sum of 4 activations (maddubs by 1, then madd), times dx
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xqp + m * K_ + b * QK));
        const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), v), _mm256_set1_epi16(1));
        _mm256_storeu_ps(xlp + (m * nb + b) * 8, _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(xdp[m * nb + b])));
      }
      for (int64_t q = 0; q < nq; ++q) {  // per quad: [dx ×2 | dx · group sums], in quad_sums' order
        auto lane_sums = [&](int64_t b) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xqp + m * K_ + b * QK));
          return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), v), _mm256_set1_epi16(1));
        };
        const __m128 d4 = _mm_loadu_ps(xdp + m * nb + 4 * q);
        const __m256 d8 = _mm256_set_m128(d4, d4);
        const __m256i g = quad_sums(lane_sums(4 * q), lane_sums(4 * q + 1), lane_sums(4 * q + 2), lane_sums(4 * q + 3));
        _mm256_storeu_ps(xqd + (m * nq + q) * 16, d8);
        _mm256_storeu_ps(xqd + (m * nq + q) * 16 + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(g), d8));
      }
    }
  });
  auto out = torch::empty({M, N}, x.options());
  const Rows w{codes.data_ptr<uint8_t>(), codes.size(1), meta.data_ptr<uint8_t>(), meta.size(1)};
  const Acts a{xqp, xdp, xlp, xqd, nb, nq};
  float* y = out.data_ptr<float>();
  at::parallel_for(0, (N + 15) / 16, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * 16, n1 = std::min(N, n0 + 16);
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) tile_rows<K, 4>(w, a, m, n0, n1, N, y);
      switch (M - m) {
        case 3: tile_rows<K, 3>(w, a, m, n0, n1, N, y); break;
        case 2: tile_rows<K, 2>(w, a, m, n0, n1, N, y); break;
        case 1: tile_rows<K, 1>(w, a, m, n0, n1, N, y); break;
        default: break;
      }
    }
  });
  return out;
}

// fp32 or bf16 weights [N, K]: (d·sc)·(u - OFF) [+ dmin·mc] in that order, the reference's floats bit for bit
// (then torch's bf16 rounding). For large batches: a float GEMM on the dequantized rows (kblock_weight.py).
template <class K, typename Out>
torch::Tensor dequantize(torch::Tensor codes, torch::Tensor meta) {
  int64_t nb = 0;
  check<K>(codes, meta, nb);
  const int64_t N = codes.size(0), K_ = nb * QK;
  auto out = torch::empty({N, K_}, torch::dtype(c10::CppTypeToScalarType<Out>::value));
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint8_t* mp = meta.data_ptr<uint8_t>();
  Out* op = out.template data_ptr<Out>();
  const int64_t cs = codes.size(1), ms = meta.size(1);
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t b = 0; b < nb; ++b) {
        const __m256i u = load_codes<K::BITS>(cp + n * cs + b * K::BB);
        __m256 sv, mv;
        block_scales<K>(mp + n * ms, nb, b, false, sv, mv);
        const __m128i lo = _mm256_castsi256_si128(u), hi = _mm256_extracti128_si256(u, 1);
        const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int e = 0; e < 4; ++e) {
          const __m256i q = _mm256_sub_epi32(_mm256_cvtepu8_epi32(parts[e]), _mm256_set1_epi32(K::OFF));
          // elements 8e..8e+7: the first 16 take the group-0 scale (lanes 0-3 of sv), the next 16 group 1's
          const __m256 s = _mm256_set1_ps(e < 2 ? _mm256_cvtss_f32(sv) : _mm256_cvtss_f32(_mm256_permute2f128_ps(sv, sv, 1)));
          __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(q), s);
          if constexpr (K::MIN) {
            const __m256 m = _mm256_set1_ps(e < 2 ? _mm256_cvtss_f32(mv) : _mm256_cvtss_f32(_mm256_permute2f128_ps(mv, mv, 1)));
            v = K::SB > 1 ? _mm256_sub_ps(v, m) : _mm256_add_ps(v, m);
          }
          store8(op + n * K_ + b * QK + 8 * e, v);
        }
      }
  });
  return out;
}

template <class K>
void define(py::module_& m, const char* name) {
  const std::string n(name);
  m.def((n + "_matmul").c_str(), &matmul<K>, "x[M,K] fp32 · W[N,K]ᵀ, W as (codes, meta) (kblocks.py)");
  m.def((n + "_dequantize").c_str(), &dequantize<K, float>, "(codes, meta) → fp32 [N, K]");
  m.def((n + "_dequantize_bf16").c_str(), &dequantize<K, at::BFloat16>, "(codes, meta) → bf16 [N, K]");
  m.def((n + "_capsule").c_str(), []() {  // for C++ callers (attention/csrc/decode_stack.h), as quant_matmul.cpp's
    return py::capsule(reinterpret_cast<void*>(&matmul<K>), "forwardpass.quant_matmul");
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  define<Q4_1>(m, "q4_1");
  define<Q5_0>(m, "q5_0");
  define<Q5_1>(m, "q5_1");
  define<Q2_K>(m, "q2_k");
  define<Q3_K>(m, "q3_k");
  define<Q4_K>(m, "q4_k");
  define<Q5_K>(m, "q5_k");
  define<Q6_K>(m, "q6_k");
  m.def("calls", []() { return g_calls.load(); }, "matmuls this module has run");
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  m.attr("isa") = "avx512vnni";
#else
  m.attr("isa") = "avx2";
#endif
}
