// What the kernels use of torch/extension.h, without the rest: ATen's tensors and ops, pybind11 with the
// tensor type casters, and the torch:: names (torch::Tensor, torch::empty, torch::kFloat32) the sources are
// written with. torch/extension.h also parses the whole C++ frontend (torch::nn, optim, data loaders,
// autograd's generated factories), which none of them calls: that was about two thirds of every kernel's
// compile time (g++ -O3, user CPU: 31 s for paged_decode.cpp with it, ~11 s with this header).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

namespace torch {
using namespace at;  // NOLINT: as torch/types.h does
constexpr auto kUInt8 = at::kByte;
constexpr auto kInt8 = at::kChar;
constexpr auto kInt16 = at::kShort;
constexpr auto kInt32 = at::kInt;
constexpr auto kInt64 = at::kLong;
constexpr auto kFloat16 = at::kHalf;
constexpr auto kFloat32 = at::kFloat;
constexpr auto kFloat64 = at::kDouble;
}  // namespace torch
