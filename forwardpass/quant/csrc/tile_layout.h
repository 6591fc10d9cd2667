// The tile layout of a block-quantized weight: what both builds' tile kernels (tiles.h: AVX-512 VNNI,
// tiles_avx2.h: AVX2) and the conversion to floats (quant_matmul.cpp) agree on.
//
// Rows 16t .. 16t+R of W [N, ·] (R = 16, or N mod 16 for the last tile) keep their place in the tensor (the same
// bytes, the same shape); inside it, with k = 32b + c:
//   Q8_0: the int8 value of row r at ((b·8 + c/4)·R + r)·4 + c%4
//   Q4_0: the byte at ((b·4 + c/8)·R + r)·4 + c%4 holds the nibbles of c (c%8 < 4, low) and c + 4 (high)
//   scales: d of (row r, block b) at b·R + r of the tile's R·nb scales
// forwardpass/quant/tiles.py converts between the layouts (the reference for these offsets).
#pragma once

#include <algorithm>
#include <cstdint>

namespace tiles {

struct Tile {
  int64_t rows;      // R: 16, or fewer for the last tile
  int64_t w_offset;  // where the tile's bytes start in the values tensor
  int64_t d_offset;  // ... and its scales in the scales tensor
};

inline Tile tile_of(int64_t t, int64_t N, int64_t w_stride, int64_t nb) {
  return {std::min<int64_t>(16, N - 16 * t), 16 * t * w_stride, 16 * t * nb};
}

// the byte offset, within a tile of R rows, of 4-byte group g of block b of row r (Q8_0: 8 groups of 4 k per
// block; Q4_0: 4 groups of 8 k, two nibbles per byte)
template <bool Q4>
inline int64_t group_offset(int64_t b, int64_t g, int64_t R, int64_t r) {
  return ((b * (Q4 ? 4 : 8) + g) * R + r) * 4;
}

}  // namespace tiles
