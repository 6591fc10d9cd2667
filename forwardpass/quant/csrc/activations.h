// The activation side shared by the quantized-matmul kernels (quant_matmul.cpp, kblock_matmul.cpp): each row of
// fp32 activations quantized to int8 per block of 32, exactly as forwardpass/quant/reference.py does, and the
// fp32 → bf16 rounding of the dequantizers.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "block_weights.h"

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One row of activations → int8 blocks + fp32 scales. d = absmax / 127, q = round_half_even(x · (1 / d));
// the reference does exactly these float operations, so both produce the same bytes. The tail of the last
// block (K not a multiple of 32) is zero.
inline void quantize_row(const float* x, int64_t K, int64_t nb, int8_t* q, float* d) {
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

// fp32 → bf16 with round-to-nearest-even (torch's rounding; the values are finite), 8 at a time.
inline __m128i to_bf16(__m256 v) {
  __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  b = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
}

inline void store8(float* dst, __m256 v) { _mm256_storeu_ps(dst, v); }
inline void store8(at::BFloat16* dst, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), to_bf16(v)); }

