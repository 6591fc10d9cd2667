// A 16×16 fp32 transpose in AVX-512 registers, shared by the kernels that lay 16 rows across a vector's lanes
// (layers/csrc/small_matmul.cpp's broadcast kernel, quant/csrc/amx_matmul.cpp's tile stores); in forwardpass/csrc/,
// the folder of headers kernels of two folders include (kernel_build.py: SHARED_CSRC, an include path of both).
#pragma once
#include <immintrin.h>

// r[i] = row i in, row i of the transpose (column i) out: 4×4 blocks within the 128-bit lanes, then the lanes.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + s]: within each lane, column 4L + s of rows 4i..4i+3
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int s = 0; s < 4; ++s) {  // output rows s, 4 + s, 8 + s, 12 + s
    const __m512 v = _mm512_shuffle_f32x4(r[s], r[4 + s], 0x88), w = _mm512_shuffle_f32x4(r[8 + s], r[12 + s], 0x88);
    const __m512 v2 = _mm512_shuffle_f32x4(r[s], r[4 + s], 0xDD), w2 = _mm512_shuffle_f32x4(r[8 + s], r[12 + s], 0xDD);
    t[s] = _mm512_shuffle_f32x4(v, w, 0x88);
    t[4 + s] = _mm512_shuffle_f32x4(v2, w2, 0x88);
    t[8 + s] = _mm512_shuffle_f32x4(v, w, 0xDD);
    t[12 + s] = _mm512_shuffle_f32x4(v2, w2, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}
