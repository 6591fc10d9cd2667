// The GGUF types beyond Q8_0/Q4_0 (Q4_1, Q5_0, Q5_1 and the K-quants Q2_K..Q6_K), multiplied from their codes and
// scales as the file stores them, repacked without rounding into tiles of 16 rows (forwardpass/quant/kblocks.py::pack
// has the byte offsets; kblock_tiles.h the inner loop and why tiles):
//
//   codes [N, nb·BB] uint8: per block of 32 weights 16 bytes of nibbles and, for 5- and 6-bit codes, 4 or 8 bytes
//     of high bits;
//   meta [N, row bytes] uint8: fp16 d (per block, or per super-block of 8 blocks), fp16 dmin where the type has mins,
//     then for K-quants the int8 scale of each group of G weights and the int8 min factor of each group.
//
// weight = (d · sc) · (u - OFF) + dmin (Q4_1, Q5_1) or - dmin · mc (K-quants), u the unsigned code. The activations
// are quantized to int8 per block of 32 (quantize_row, llama.cpp's recipe), then per group one unsigned × signed int8
// dot product per output row (vpdpbusd in the AVX-512 VNNI build, maddubs + madd in the AVX2 build), one convert and
// one FMA; the mins ride on the activations' group sums, the code offset starts the integer sums.
//
// Reference: forwardpass/quant/kblocks.py (reference_matmul: the dequantized int8 activations times the dequantized
// weights in fp32; they differ in float rounding only). Threads: at::parallel_for over the tiles (torch's pool).
#include "torch_ext.h"  // forwardpass/csrc/: torch/extension.h less the C++ frontend
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "activations.h"
#include "kblock_tiles.h"
#ifdef KB_AVX2
#include "kblock_gemm_avx2.h"
#endif
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512VNNI__)
#include "kblock_amx.h"
#define KB_AMX 1
#endif

namespace {

using kb::Kind;
using kb::TILE;

std::atomic<int64_t> g_calls{0};  // matmuls run (tests assert that this kernel, not a fallback, computed)
std::atomic<int64_t> g_amx_calls{0};  // of those, the ones whose sums came from AMX tiles (kblock_amx.h)
// batches of this many rows and more take the AMX tiles where the CPU has them (0: never; set_amx_min_rows):
// below 9 rows the VNNI loop is as fast or faster (Sapphire Rapids, SmolLM2 matrices: at 2 rows 2x slower on
// AMX, at 9 even, at 12-31 rows AMX 15-28% faster)
std::atomic<int64_t> g_amx_min_rows{9};
// activation rows that pass a weight tile together (set_rows_per_pass; at most kb::MAX_MR): each pass unpacks the
// tile's codes once, so 9 rows cost two unpacks at 8 per pass, three at 4 (the rest of a tile's rows: one pass)
std::atomic<int64_t> g_rows_per_pass{kb::MAX_MR};
// the AVX2 build's GEMM mode (kblock_gemm_avx2.h) from this many rows on (0: never; set_gemm_min_rows), and the
// matmuls that took it
std::atomic<int64_t> g_gemm_min_rows{3};
std::atomic<int64_t> g_gemm_calls{0};
// activation rows per chunk of the GEMM mode and of the tile passes (a chunk's int8 rows stay in L2 while every
// tile passes them)
constexpr int64_t GEMM_CHUNK = 256;

bool use_amx(int64_t M) {
#ifdef KB_AMX
  const int64_t from = g_amx_min_rows.load(std::memory_order_relaxed);
  return from > 0 && M >= from && kb::amx_int8_usable();
#else
  (void)M;
  return false;
#endif
}

using Q4_1 = Kind<4, 1, 32, true, 0>;
using Q5_0 = Kind<5, 1, 32, false, 16>;
using Q5_1 = Kind<5, 1, 32, true, 0>;
using Q2_K = Kind<4, 8, 16, true, 0>;
using Q3_K = Kind<4, 8, 16, false, 4>;
using Q4_K = Kind<4, 8, 32, true, 0>;
using Q5_K = Kind<5, 8, 32, true, 0>;
using Q6_K = Kind<6, 8, 16, false, 32>;
using Q8_0 = Kind<8, 1, 32, false, 128>;  // only as a part of a stack (below): alone it has its own kernels

template <class K>
void check(const torch::Tensor& codes, const torch::Tensor& meta, int64_t& nb) {
  TORCH_CHECK(codes.dtype() == torch::kUInt8 && codes.dim() == 2 && codes.is_contiguous(), "codes: uint8 [N, bytes]");
  TORCH_CHECK(meta.dtype() == torch::kUInt8 && meta.dim() == 2 && meta.is_contiguous(), "meta: uint8 [N, bytes]");
  TORCH_CHECK(codes.size(1) % K::BB == 0, "a code row of ", codes.size(1), " bytes is not whole blocks");
  nb = codes.size(1) / K::BB;
  TORCH_CHECK(nb % K::SB == 0 && meta.size(0) == codes.size(0) && meta.size(1) == K::meta_bytes(nb),
              "meta does not match ", nb, " blocks per row");
}

// Activation row m: int8 blocks and scales (quantize_row), each half block's Σ x as the code offset's integer
// start (-OFF · Σ) and, for types with mins, dx · Σ x per group.
template <class K>
void prepare(const float* x, int64_t K_, int64_t nb, int8_t* xq, float* xd, int32_t* xo, float* xm) {
  quantize_row(x, K_, nb, xq, xd);
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * QK));
    const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), v), _mm256_set1_epi16(1));
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), s);
    const int32_t h0 = lanes[0] + lanes[1] + lanes[2] + lanes[3], h1 = lanes[4] + lanes[5] + lanes[6] + lanes[7];
    xo[2 * b] = -K::OFF * h0;
    xo[2 * b + 1] = -K::OFF * h1;
    if (K::GPB == 1) {
      xm[2 * b] = xd[b] * static_cast<float>(h0 + h1);
      xm[2 * b + 1] = 0.0f;
    } else {
      xm[2 * b] = xd[b] * static_cast<float>(h0);
      xm[2 * b + 1] = xd[b] * static_cast<float>(h1);
    }
  }
}

// The last `rows` (< MR) activation rows of a tile in one pass of exactly that many: a 3-, 5-, 6- or 7-row
// verify step used to pass the tile as 2 + 1, 4 + 1, 4 + 2 or 4 + 2 + 1 rows, unpacking its codes once per pass
// (a 3-row matmul cost more than a 4-row one). Each row's sums are its own whatever passes with it.
template <class K, int MR>
void tail_rows(const uint8_t* tc, const uint8_t* tm, int64_t R, const kb::Acts& a, int64_t m, int64_t rows,
               float* y, int64_t N) {
  if constexpr (MR > 0) {
    if (rows == MR)
      kb::tile_dot<K, MR>(tc, tm, R, a, m, y, N);
    else
      tail_rows<K, MR - 1>(tc, tm, R, a, m, rows, y, N);
  }
}

template <class K, int MR>
void rows_of_tile(const uint8_t* tc, const uint8_t* tm, int64_t R, const kb::Acts& a, int64_t m0, int64_t m1,
                  float* y, int64_t N) {
  int64_t m = m0;
  for (; m + MR <= m1; m += MR) kb::tile_dot<K, MR>(tc, tm, R, a, m, y, N);
  if (m < m1) tail_rows<K, MR - 1>(tc, tm, R, a, m, m1 - m, y, N);
}

// Passes of up to MAX_MR rows over each tile (tile_dot), or AMX tiles: the decode-sized batches of every build.
// Its own function, not inlined into the dispatch below, and with the activations prepared in its own body as
// before the GEMM mode existed: in any other arrangement tried GCC allocated the two-row loop's registers
// otherwise and it ran 7-15% slower.
template <class K>
__attribute__((noinline)) torch::Tensor tile_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor meta) {
  int64_t nb = 0;
  check<K>(codes, meta, nb);
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == nb * QK, "x must be float32 [M, ", nb * QK,
              "]");
  x = x.contiguous();
  g_calls.fetch_add(1, std::memory_order_relaxed);
  const int64_t M = x.size(0), N = codes.size(0), K_ = nb * QK;
  // AMX loads 16 activation rows per tile: zero rows pad the last pass (their sums are never read)
  const bool amx = use_amx(M);
  const int64_t padded = amx ? (M + kb::TILE - 1) / kb::TILE * kb::TILE : M;
  auto xq = torch::empty({padded, K_}, x.options().dtype(torch::kInt8));
  if (padded > M) xq.narrow(0, M, padded - M).zero_();
  auto xd = torch::empty({M, nb}, x.options());
  auto xo = torch::empty({M, nb * 2}, x.options().dtype(torch::kInt32));
  auto xm = torch::empty({M, nb * 2}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* xqp = xq.data_ptr<int8_t>();
  float* xdp = xd.data_ptr<float>();
  int32_t* xop = xo.data_ptr<int32_t>();
  float* xmp = xm.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      prepare<K>(xp + m * K_, K_, nb, xqp + m * K_, xdp + m * nb, xop + m * nb * 2, xmp + m * nb * 2);
  });
  auto out = torch::empty({M, N}, x.options());
  const kb::Acts a{xqp, xdp, xop, xmp, nb};
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint8_t* mp = meta.data_ptr<uint8_t>();
  const int64_t cs = codes.size(1), ms = meta.size(1);
  float* y = out.data_ptr<float>();
  // each tile's codes (16 rows: 8-12 KB at K = 1536) stay in L1 while every activation row of a chunk passes
  // them; chunks of rows (prefill on the VNNI build, which takes every batch where the CPU has no AMX) keep
  // their int8 rows in L2 while every tile passes them, as the GEMM mode's do
  if (amx) g_amx_calls.fetch_add(1, std::memory_order_relaxed);
  const int64_t tiles = (N + TILE - 1) / TILE, chunks = amx ? 1 : (M + GEMM_CHUNK - 1) / GEMM_CHUNK;
  at::parallel_for(0, tiles * chunks, 1, [&](int64_t u0, int64_t u1) {
#ifdef KB_AMX
    if (amx) {  // one chunk: a unit is a tile
      kb::amx_configure<K>();  // per thread: the tile state is
      for (int64_t t = u0; t < u1; ++t) {
        const int64_t n0 = t * TILE, R = std::min<int64_t>(TILE, N - n0);
        for (int64_t m0 = 0; m0 < M; m0 += kb::AMX_ROWS)
          kb::amx_tile_rows<K>(cp + n0 * cs, mp + n0 * ms, R, a, m0, std::min(kb::AMX_ROWS, M - m0), y + n0, N);
      }
      _tile_release();
      return;
    }
#endif
    const int64_t per_pass = g_rows_per_pass.load(std::memory_order_relaxed);
    // chunk-major units (a thread's units share their chunk of rows), walked without a division per unit:
    // a one-row decode call over ~100 tiles takes ~15 us
    int64_t t = u0 % tiles, m0 = u0 / tiles * GEMM_CHUNK;
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t n0 = t * TILE, R = std::min<int64_t>(TILE, N - n0), m1 = std::min(M, m0 + GEMM_CHUNK);
      if (per_pass >= 8 && kb::MAX_MR >= 8)
        rows_of_tile<K, kb::MAX_MR>(cp + n0 * cs, mp + n0 * ms, R, a, m0, m1, y + n0, N);
      else
        rows_of_tile<K, std::min(4, kb::MAX_MR)>(cp + n0 * cs, mp + n0 * ms, R, a, m0, m1, y + n0, N);
      if (++t == tiles) t = 0, m0 += GEMM_CHUNK;
    }
  });
  return out;
}

#ifdef KB_AVX2
// The AVX2 build's GEMM mode (kblock_gemm_avx2.h) over every tile and chunk of rows: the activations as tile_matmul
// prepares them, then chunk × tile units over the threads.
template <class K>
__attribute__((noinline)) torch::Tensor gemm_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor meta) {
  int64_t nb = 0;
  check<K>(codes, meta, nb);
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == nb * QK, "x must be float32 [M, ", nb * QK,
              "]");
  x = x.contiguous();
  g_calls.fetch_add(1, std::memory_order_relaxed);
  g_gemm_calls.fetch_add(1, std::memory_order_relaxed);
  const int64_t M = x.size(0), N = codes.size(0), K_ = nb * QK;
  auto xq = torch::empty({M, K_}, x.options().dtype(torch::kInt8));
  auto xd = torch::empty({M, nb}, x.options());
  auto xo = torch::empty({M, nb * 2}, x.options().dtype(torch::kInt32));
  auto xm = torch::empty({M, nb * 2}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* xqp = xq.data_ptr<int8_t>();
  float* xdp = xd.data_ptr<float>();
  int32_t* xop = xo.data_ptr<int32_t>();
  float* xmp = xm.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      prepare<K>(xp + m * K_, K_, nb, xqp + m * K_, xdp + m * nb, xop + m * nb * 2, xmp + m * nb * 2);
  });
  const kb::Acts a{xqp, xdp, xop, xmp, nb};
  auto out = torch::empty({M, N}, x.options());
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint8_t* mp = meta.data_ptr<uint8_t>();
  const int64_t cs = codes.size(1), ms = meta.size(1);
  float* y = out.data_ptr<float>();
  const int64_t tiles = (N + TILE - 1) / TILE, chunks = (M + GEMM_CHUNK - 1) / GEMM_CHUNK;
  at::parallel_for(0, tiles * chunks, 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {  // chunk-major: a thread's units share their chunk of rows
      const int64_t t = u % tiles, m0 = u / tiles * GEMM_CHUNK, n0 = t * TILE;
      kb::gemm_tile<K>(cp + n0 * cs, mp + n0 * ms, std::min<int64_t>(TILE, N - n0), a, m0,
                       std::min(M, m0 + GEMM_CHUNK), y + n0, N);
    }
  });
  return out;
}
#endif

// x [M, K] fp32 · Wᵀ: the AVX2 build's GEMM mode from g_gemm_min_rows rows on, else the tile passes.
template <class K>
torch::Tensor matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor meta) {
#ifdef KB_AVX2
  const int64_t from = g_gemm_min_rows.load(std::memory_order_relaxed);
  if (from > 0 && x.dim() == 2 && x.size(0) >= from) return gemm_matmul<K>(x, codes, meta);
#endif
  return tile_matmul<K>(x, codes, meta);
}

// The 32 codes of row r, block b of a tile (the layout of kblocks.py::pack).
template <class K>
inline void row_codes(const uint8_t* p, int64_t R, int64_t r, uint8_t u[32]) {
  if constexpr (K::BITS == 8) {
    for (int v = 0; v < 8; ++v) std::memcpy(u + 4 * v, p + (v * R + r) * 4, 4);
    return;
  }
  for (int g = 0; g < 4; ++g) {
    uint32_t w;
    std::memcpy(&w, p + (g * R + r) * 4, 4);
    const uint32_t lo = w & 0x0F0F0F0Fu, hi = (w >> 4) & 0x0F0F0F0Fu;
    std::memcpy(u + 8 * g, &lo, 4);
    std::memcpy(u + 8 * g + 4, &hi, 4);
  }
  if constexpr (K::BITS == 5) {
    uint32_t h;
    std::memcpy(&h, p + (16 * R + r * 4), 4);
    for (int j = 0; j < 8; ++j) {  // elements 4j + c: bit j of byte c
      uint32_t v;
      std::memcpy(&v, u + 4 * j, 4);
      v |= ((h >> j) & 0x01010101u) << 4;
      std::memcpy(u + 4 * j, &v, 4);
    }
  }
  if constexpr (K::BITS == 6) {
    for (int q = 0; q < 2; ++q) {
      uint32_t h;
      std::memcpy(&h, p + 16 * R + (q * R + r) * 4, 4);
      for (int j = 0; j < 4; ++j) {  // elements 16q + 4j + c: bits 2j, 2j + 1 of byte c
        uint32_t v;
        std::memcpy(&v, u + 16 * q + 4 * j, 4);
        v |= ((h >> (2 * j)) & 0x03030303u) << 4;
        std::memcpy(u + 16 * q + 4 * j, &v, 4);
      }
    }
  }
}

// fp32 or bf16 weights [N, K]: (d·sc)·(u - OFF) [± dmin·mc] in that order, the reference's floats bit for bit
// (then torch's bf16 rounding). For large batches: a float GEMM on the dequantized rows (kblock_weight.py).
// Slices of rows must be whole tiles (they start at a multiple of 16).
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
  at::parallel_for(0, (N + TILE - 1) / TILE, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * TILE, R = std::min<int64_t>(TILE, N - n0);
      const kb::TileMeta<K> meta_t(mp + n0 * ms, R, nb);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t b = 0; b < nb; ++b) {
          alignas(32) uint8_t u[32];
          row_codes<K>(cp + n0 * cs + b * K::BB * R, R, r, u);
          const int64_t sb = b / K::SB * R + r;
          const float d = _cvtsh_ss(meta_t.d[sb]);
          float s[2] = {d, d}, mn[2] = {0.0f, 0.0f};
          for (int h = 0; h < 2; ++h) {
            const int64_t j = (b * K::GPB + (K::GPB == 2 ? h : 0)) * R + r;
            int sc = 0, mc = 0;
            if constexpr (K::PACK6) {
              meta_t.factors(b, R, r, &sc, &mc);
            } else if constexpr (K::SB > 1) {
              sc = meta_t.sc[j];
              if constexpr (K::MIN) mc = meta_t.mc[j];
            }
            if constexpr (K::SB > 1) s[h] = d * static_cast<float>(sc);
            if constexpr (K::MIN) {
              const float dm = _cvtsh_ss(meta_t.dm[sb]);
              mn[h] = K::SB > 1 ? dm * static_cast<float>(mc) : dm;
            }
          }
          for (int e = 0; e < 4; ++e) {  // elements 8e .. 8e + 7: the first 16 in group 0, the next in group 1
            const __m128i c8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(u + 8 * e));
            const __m256i q = _mm256_sub_epi32(_mm256_cvtepu8_epi32(c8), _mm256_set1_epi32(K::OFF));
            __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(s[e / 2]));
            if constexpr (K::MIN) {
              const __m256 m = _mm256_set1_ps(mn[e / 2]);
              v = K::SB > 1 ? _mm256_sub_ps(v, m) : _mm256_add_ps(v, m);
            }
            store8(op + (n0 + r) * K_ + b * QK + 8 * e, v);
          }
        }
    }
  });
  return out;
}

// A stack of matrices of different kinds along the output rows (a merged q/k/v whose parts the file stores in
// different types: Q4_K_M's Q5_0 q/k beside a Q8_0 v), each part in its own kind's tiles, multiplied by its own
// kernel: codes uint8 [Σ part bytes], each part's codes after the last; meta uint8, a header of int64 (the number
// of parts P, then per part its kind's index in KIND_OPS, its rows and its K) and then each part's meta.
using MatmulFn = torch::Tensor (*)(torch::Tensor, torch::Tensor, torch::Tensor);
struct KindOps {
  MatmulFn matmul;
  int64_t code_bytes;  // per block of 32
  int64_t (*meta_bytes)(int64_t nb);
};
template <class K>
constexpr KindOps ops_of() {
  return {&matmul<K>, K::BB, &K::meta_bytes};
}
// the order of kblocks.py::STACK_KINDS
const KindOps KIND_OPS[] = {ops_of<Q4_1>(), ops_of<Q5_0>(), ops_of<Q5_1>(), ops_of<Q2_K>(), ops_of<Q3_K>(),
                            ops_of<Q4_K>(), ops_of<Q5_K>(), ops_of<Q6_K>(), ops_of<Q8_0>()};
constexpr int64_t N_KINDS = sizeof(KIND_OPS) / sizeof(KIND_OPS[0]);

torch::Tensor stack_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor meta) {
  TORCH_CHECK(codes.dtype() == torch::kUInt8 && codes.dim() == 1 && codes.is_contiguous(), "codes: uint8 [bytes]");
  TORCH_CHECK(meta.dtype() == torch::kUInt8 && meta.dim() == 1 && meta.is_contiguous() && meta.size(0) >= 8,
              "meta: uint8 [header + bytes]");
  const uint8_t* mp = meta.data_ptr<uint8_t>();
  auto field = [&](int64_t i) {
    int64_t v;
    std::memcpy(&v, mp + 8 * i, 8);
    return v;
  };
  const int64_t P = field(0), header = 8 * (1 + 3 * P);
  TORCH_CHECK(P > 0 && meta.size(0) >= header, "a stack's header is ", header, " bytes");
  std::vector<torch::Tensor> outs;
  int64_t co = 0, mo = header;
  for (int64_t p = 0; p < P; ++p) {
    const int64_t kind = field(1 + 3 * p), rows = field(2 + 3 * p), k = field(3 + 3 * p);
    TORCH_CHECK(kind >= 0 && kind < N_KINDS && rows > 0 && k % QK == 0, "part ", p, " of the stack is malformed");
    const KindOps& ops = KIND_OPS[kind];
    const int64_t cb = k / QK * ops.code_bytes, mb = ops.meta_bytes(k / QK);
    TORCH_CHECK(co + rows * cb <= codes.size(0) && mo + rows * mb <= meta.size(0), "the stack's bytes end early");
    outs.push_back(ops.matmul(x, codes.narrow(0, co, rows * cb).view({rows, cb}),
                              meta.narrow(0, mo, rows * mb).view({rows, mb})));
    co += rows * cb;
    mo += rows * mb;
  }
  TORCH_CHECK(co == codes.size(0) && mo == meta.size(0), "the stack's bytes do not match its header");
  return outs.size() == 1 ? outs[0] : torch::cat(outs, 1);
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
  define<Q8_0>(m, "q8_0");
  m.def("stack_matmul", &stack_matmul, "x[M,K] fp32 · W[N,K]ᵀ, W a stack of parts of different kinds (kblocks.py)");
  m.def("stack_capsule", []() {
    return py::capsule(reinterpret_cast<void*>(&stack_matmul), "forwardpass.quant_matmul");
  });
  m.def("calls", []() { return g_calls.load(); }, "matmuls this module has run");
  m.def("amx_calls", []() { return g_amx_calls.load(); }, "of those, the ones on AMX tiles");
  m.def("set_rows_per_pass", [](int64_t n) { return g_rows_per_pass.exchange(n); },
        "activation rows per pass over a weight tile (4 or 8; 8 only where the build has it); returns the old n");
  m.attr("max_rows_per_pass") = kb::MAX_MR;
  m.def("gemm_calls", []() { return g_gemm_calls.load(); }, "of those, the ones in the AVX2 GEMM mode");
  m.def("set_gemm_min_rows", [](int64_t n) { return g_gemm_min_rows.exchange(n); },
        "batches of n rows and more take the AVX2 build's GEMM mode (0: never); returns the old n");
#ifdef KB_AVX2
  m.attr("has_gemm_mode") = true;
#else
  m.attr("has_gemm_mode") = false;
#endif
  m.def("set_amx_min_rows", [](int64_t n) { return g_amx_min_rows.exchange(n); },
        "batches of n rows and more take AMX tiles where the CPU has them (0: never); returns the old n");
#ifdef KB_AMX
  m.attr("has_amx") = kb::amx_int8_usable();
#else
  m.attr("has_amx") = false;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  m.attr("isa") = "avx512vnni";
#else
  m.attr("isa") = "avx2";
#endif
}
