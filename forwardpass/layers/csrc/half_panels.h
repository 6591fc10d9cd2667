// Panels of bfloat16 / float16 weights (layers/half_panels.py): the fp32 panel layout of panel:: ([N/64][K][64],
// for each block of 64 outputs the 64 weights of each k side by side) with each weight in 2 bytes, upcast to
// fp32 in registers. The upcast is exact (a bfloat16 is the top half of a float32; F16C converts a float16
// exactly), so the sums are those of panel:: on the same values: one fp32 FMA chain per output, in k order,
// from zero, the bias added last — bit for bit the fp32 panels' result, whatever the batch size. What changes is
// the bytes: a decode step streams half of them from memory, and a bf16 checkpoint is held in its own size.
//
// * one row (batch-1 decode): all 64 outputs of a panel in NV accumulators, the weights converted as they load;
// * more rows: a chunk of KC k's of the panel is converted once into an fp32 buffer (64 KB on AVX2, L2), strip by
//   strip of SV vectors of outputs (a strip contiguous: 16 KB on AVX2, in L1 while it is used; 1.05-1.16x over
//   the panel's own row order, which maps a strip's rows to a quarter of L1's sets), then register blocks of RB
//   rows × SV vectors pass over each strip (AVX2: 6 rows × 16 outputs = 12 accumulators, 2 weight vectors and a
//   broadcast of the 16 registers; per k 8 loads feed 12 FMAs, where panel::'s one-row block needs 9 for 8;
//   AVX-512: the whole panel, below), the partial sums parked in y between chunks (a float stored and reloaded
//   is the same float, so KC changes no result).
//   Large batches (prefill chunks) run here too: there is no library GEMM that reads 2-byte weights into fp32
//   sums on a CPU without bf16 arithmetic.
// Work items are (panel, group of up to 64 rows), so a prefill chunk of a projection with few panels still
// spreads over the threads.
namespace half {

enum class Kind { bf16, fp16 };

template <Kind KIND>
inline Vec::T load(const uint16_t* p);
#if defined(__AVX512F__)
template <>
inline __m512 load<Kind::bf16>(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
template <>
inline __m512 load<Kind::fp16>(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#else
template <>
inline __m256 load<Kind::bf16>(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
template <>
inline __m256 load<Kind::fp16>(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

constexpr int64_t P = panel::P;
constexpr int NV = panel::NV;
#if defined(__AVX512F__)
// 32 zmm registers: the whole panel's 4 vectors × 6 rows = 24 accumulators, 4 weights and a broadcast; per k
// 10 loads feed 24 FMAs. Measured on a 2-core Ice Lake Xeon against the AVX2 shape (2 vectors × 6 rows, KC
// 256), benchmarks/half_panels.py, SmolLM2 and 1B shapes: 1.2-1.35x at 16-256 rows; KC 64 / 128 / 192 within
// the noise of each other, 4 rows × 4 vectors and 12 rows × 2 vectors slower
constexpr int SV = 4;            // output vectors per register block
constexpr int RB = 6;            // rows per register block
constexpr int64_t KC = 128;      // k per converted chunk: a strip of 128 × 64 floats = 32 KB, in L1
#else
constexpr int SV = 2;            // output vectors per register block
constexpr int RB = 6;            // rows per register block
constexpr int64_t KC = 256;      // k per converted chunk: 256 × 64 floats = 64 KB
#endif
constexpr int64_t ROW_GROUP = 64;  // rows per work item

// one row against the panel w over all of K → y[col..col+64)
template <Kind KIND>
inline void row1(const float* x, int64_t K, const uint16_t* w, float* y, int64_t col, const float* bias) {
  typename Vec::T acc[NV];
  for (int j = 0; j < NV; ++j) acc[j] = Vec::zero();
  for (int64_t k = 0; k < K; ++k) {
    const typename Vec::T b = Vec::bcast(x + k);
    for (int j = 0; j < NV; ++j) acc[j] = Vec::fma(b, load<KIND>(w + k * P + j * Vec::L), acc[j]);
  }
  for (int j = 0; j < NV; ++j) {
    typename Vec::T v = acc[j];
    if (bias) v = Vec::add(v, Vec::load(bias + col + j * Vec::L));
    Vec::store(y + col + j * Vec::L, v);
  }
}

// rows x[0..R) (K apart) against one strip of the converted chunk, buf [kc][SV·L] (k0 its first k): the
// panel's outputs out..out+SV·L → y[i][col + out ..] (rows N apart); `first`: start the sums at zero; `last`:
// add the bias
template <int R>
inline void block(const float* x, int64_t K, const float* buf, int64_t kc, int64_t k0, float* y, int64_t N,
                  int64_t col, int64_t out, const float* bias, bool first, bool last) {
  typename Vec::T acc[R][SV];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < SV; ++v)
      acc[i][v] = first ? Vec::zero() : Vec::load(y + i * N + col + out + v * Vec::L);
  const float* xr[R];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) xr[i] = x + i * K + k0;
  const float* wb = buf;
  for (int64_t kk = 0; kk < kc; ++kk, wb += SV * Vec::L) {
    typename Vec::T w[SV];
#pragma GCC unroll 4
    for (int v = 0; v < SV; ++v) w[v] = Vec::load(wb + v * Vec::L);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const typename Vec::T b = Vec::bcast(xr[i] + kk);
#pragma GCC unroll 4
      for (int v = 0; v < SV; ++v) acc[i][v] = Vec::fma(b, w[v], acc[i][v]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < SV; ++v) {
      typename Vec::T s = acc[i][v];
      if (last && bias) s = Vec::add(s, Vec::load(bias + col + out + v * Vec::L));
      Vec::store(y + i * N + col + out + v * Vec::L, s);
    }
}

// block<rows> for 1 ≤ rows ≤ R
template <int R>
inline void block_any(int64_t rows, const float* x, int64_t K, const float* buf, int64_t kc, int64_t k0, float* y,
                      int64_t N, int64_t col, int64_t out, const float* bias, bool first, bool last) {
  if constexpr (R > 0) {
    if (rows == R) {
      block<R>(x, K, buf, kc, k0, y, N, col, out, bias, first, last);
    } else {
      block_any<R - 1>(rows, x, K, buf, kc, k0, y, N, col, out, bias, first, last);
    }
  }
}

template <Kind KIND>
void matmul(const float* x, const uint16_t* w, const float* bias, float* y, int64_t M, int64_t K, int64_t Kp,
            int64_t N) {
  const int64_t panels = N / P;
  if (M == 1) {
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) row1<KIND>(x, K, w + p * Kp * P, y, p * P, bias);
    });
    return;
  }
  const int64_t groups = (M + ROW_GROUP - 1) / ROW_GROUP;
  at::parallel_for(0, panels * groups, 1, [&](int64_t i0, int64_t i1) {
    std::unique_ptr<float[]> buf(new float[KC * P]);
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t p = item / groups, m0 = item % groups * ROW_GROUP, m1 = std::min(M, m0 + ROW_GROUP);
      const uint16_t* wp = w + p * Kp * P;
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = std::min(KC, K - k0);
        // strip-major: the SV vectors of strip s for every k side by side ([strip][kk][SV·L]), so a strip is
        // one contiguous 16 KB (AVX2) that stays in L1 while the row blocks pass over it
        for (int64_t kk = 0; kk < kc; ++kk)
          for (int j = 0; j < NV; ++j)
            Vec::store(buf.get() + (j / SV) * kc * SV * Vec::L + kk * SV * Vec::L + (j % SV) * Vec::L,
                       load<KIND>(wp + (k0 + kk) * P + j * Vec::L));
        for (int s = 0; s < NV / SV; ++s)
          for (int64_t m = m0; m < m1; m += RB)
            block_any<RB>(std::min<int64_t>(RB, m1 - m), x + m * K, K, buf.get() + s * kc * SV * Vec::L, kc, k0,
                          y + m * N, N, p * P, s * SV * Vec::L, bias, k0 == 0, k0 + kc >= K);
      }
    }
  });
}

}  // namespace half
