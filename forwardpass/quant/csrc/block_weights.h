// The block-quantized weight layout both quantized-matmul kernels take (quant_matmul.cpp, amx_matmul.cpp):
// W [N, K] in blocks of 32 weights along K, one fp16 scale per block; Q8_0 values int8 [N, nb·32], Q4_0 nibbles
// uint8 [N, nb·16] (the GGUF layouts). One check of the arguments against it, for both, and the block unpacking
// the quant_matmul.cpp build shares with its VNNI GEMM (vnni_gemm.h).
#pragma once
#include "torch_ext.h"  // forwardpass/csrc/
#include <immintrin.h>

#include <cstdint>

constexpr int64_t QK = 32;  // weights per block

struct BlockMatmulShape {
  int64_t M, K, N, nb, w_stride;  // x [M, K] · W[N, K]ᵀ; nb blocks per weight row of w_stride bytes
};

// Checks x [M, K] fp32, the values and the scales of a Q8_0 / Q4_0 matrix, makes all three contiguous (in place)
// and returns the shape.
template <bool Q4>
BlockMatmulShape check_block_matmul(torch::Tensor& x, torch::Tensor& wq, torch::Tensor& wd) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "x must be a 2-D float32 tensor");
  TORCH_CHECK(wd.dtype() == torch::kFloat16 && wd.dim() == 2, "scales must be a 2-D float16 tensor");
  TORCH_CHECK(wq.dtype() == (Q4 ? torch::kUInt8 : torch::kInt8),
              Q4 ? "Q4_0 values must be uint8" : "Q8_0 values must be int8");
  x = x.contiguous();
  wq = wq.contiguous();
  wd = wd.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = wq.size(0), nb = wd.size(1);
  TORCH_CHECK(wd.size(0) == N && nb * QK >= K && (nb - 1) * QK < K, "scales do not match K=", K);
  const int64_t w_stride = Q4 ? nb * QK / 2 : nb * QK;
  TORCH_CHECK(wq.size(1) == w_stride, "packed weight row has ", wq.size(1), " bytes, expected ", w_stride);
  return {M, K, N, nb, w_stride};
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
