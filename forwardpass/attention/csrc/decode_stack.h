// The layers of a Llama-family decoder for one decode step, run from C++: the same kernels the PyTorch modules
// call (RMSNorm, the q/k-norm + rotary, the K/V store, paged decode, SwiGLU, and the matmul kernels of the
// weights' format), in the same order on the same tensors, so the hidden states are bitwise those of the
// module path (forwardpass/models/llama.py::DecoderLayer). What it saves is the Python between the kernels:
// ~15 module calls, views and checks per layer, ~4 ms of a 28-layer model's decode step, a sixth of an int8
// token on a two-core machine.
//
// The matmul kernels live in other extensions (the small-batch fp32 matmul, the quantized matmul of the host's
// ISA). Each exports its entry point as a PyCapsule named after the signature, and a Projection calls it
// through that pointer: both sides are compiled against the same torch headers by the same compiler.
// Included by paged_decode.cpp, after the fused ops it calls.
#pragma once

#include <string>
#include <vector>

namespace decode_stack {

using QuantMatmul = torch::Tensor (*)(torch::Tensor, torch::Tensor, torch::Tensor);
using DenseMatmul = torch::Tensor (*)(torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>);
constexpr const char* kQuantCapsule = "forwardpass.quant_matmul";  // (x, values, scales) -> x · Wᵀ
constexpr const char* kDenseCapsule = "forwardpass.dense_matmul";  // (x, weight, bias) -> x · Wᵀ + bias

inline std::string capsule_name(const py::capsule& c) { return c.name() ? c.name() : ""; }

// One linear layer: x [T, K] -> [T, N] through its format's kernel.
struct Projection {
  QuantMatmul quant = nullptr;
  QuantMatmul gemm = nullptr;  // a quantized weight's GEMM for gemm_rows rows and more (the VNNI build), or none
  int64_t gemm_rows = 0;
  DenseMatmul dense = nullptr;
  torch::Tensor a, b;  // dense: the fp32 weight (b unused); quantized: values and block scales
  c10::optional<torch::Tensor> bias;

  Projection() = default;
  Projection(py::capsule kernel, torch::Tensor a_, c10::optional<torch::Tensor> b_, c10::optional<torch::Tensor> bias_,
             py::object gemm_kernel, int64_t gemm_rows_)
      : gemm_rows(gemm_rows_), a(std::move(a_)), bias(std::move(bias_)) {
    const std::string name = capsule_name(kernel);
    if (name == kQuantCapsule) {
      TORCH_CHECK(b_.has_value(), "a quantized projection needs its scales");
      quant = reinterpret_cast<QuantMatmul>(kernel.get_pointer());
      b = *b_;
      if (!gemm_kernel.is_none()) {
        const py::capsule g = gemm_kernel.cast<py::capsule>();
        TORCH_CHECK(capsule_name(g) == kQuantCapsule && gemm_rows > 0, "not a quantized GEMM capsule");
        gemm = reinterpret_cast<QuantMatmul>(g.get_pointer());
      }
    } else {
      TORCH_CHECK(name == kDenseCapsule && gemm_kernel.is_none(), "not a matmul kernel capsule: ", name);
      dense = reinterpret_cast<DenseMatmul>(kernel.get_pointer());
    }
  }

  // as a linear layer's weight method (layers/weight_methods.py): the dense kernel adds the bias itself; a
  // quantized weight's output gets it added after, and from gemm_rows rows on it multiplies with its GEMM
  // (QuantizedWeight.matmul)
  torch::Tensor operator()(const torch::Tensor& x) const {
    if (dense) return dense(x, a, bias);
    torch::Tensor out = gemm && x.size(0) >= gemm_rows ? gemm(x, a, b) : quant(x, a, b);
    if (bias) out.add_(*bias);
    return out;
  }
};

struct Layer {
  torch::Tensor input_norm, post_norm;
  double input_eps, post_eps;
  c10::optional<torch::Tensor> q_norm, k_norm;  // per-head q/k RMSNorm (Qwen3), or none
  double qk_eps;
  Projection qkv, o, gate_up, down;
  double scale;
  int64_t window;  // sliding window, 0 for full attention
};

class Stack {
 public:
  Stack(int64_t heads, int64_t kv_heads, int64_t head_dim) : Hq(heads), Hkv(kv_heads), D(head_dim) {}

  void add_layer(torch::Tensor input_norm, double input_eps, torch::Tensor post_norm, double post_eps,
                 c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm, double qk_eps,
                 Projection qkv, Projection o, Projection gate_up, Projection down, double scale, int64_t window) {
    layers.push_back(Layer{std::move(input_norm), std::move(post_norm), input_eps, post_eps, std::move(q_norm),
                           std::move(k_norm), qk_eps, std::move(qkv), std::move(o), std::move(gate_up),
                           std::move(down), scale, window});
  }

  // x [T, hidden]: the embedded decode tokens, one per sequence; cos/sin [T, D]. Per layer: its KV cache and the
  // index of its cache group; per group: slot mapping, decode block tables and lengths (AttentionContext).
  // Returns the last layer's output (before the final norm).
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, const std::vector<torch::Tensor>& kv_caches,
                        const std::vector<int64_t>& layer_group, const std::vector<torch::Tensor>& slot_mappings,
                        const std::vector<torch::Tensor>& block_tables, const std::vector<torch::Tensor>& seq_lens) const {
    const int64_t L = static_cast<int64_t>(layers.size());
    TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) == L && static_cast<int64_t>(layer_group.size()) == L,
                "one KV cache and one group per layer");
    TORCH_CHECK(slot_mappings.size() == block_tables.size() && slot_mappings.size() == seq_lens.size(),
                "one slot mapping, block table and length tensor per group");
    TORCH_CHECK(x.dim() == 2 && cos.size(-1) == D, "x [T, hidden], cos/sin [T, head_dim]");
    const int64_t T = x.size(0);
    for (int64_t l = 0; l < L; ++l) {
      const Layer& ly = layers[l];
      const size_t g = static_cast<size_t>(layer_group[l]);
      TORCH_CHECK(g < slot_mappings.size(), "layer ", l, ": no group ", g);
      // attention: DecoderAttention.forward's fused path, then CachedAttention's pure-decode step
      torch::Tensor qkv = ly.qkv(rms_norm(x, ly.input_norm, ly.input_eps));
      qk_norm_rope_(qkv, cos, sin, Hq, Hkv, D, ly.q_norm, ly.k_norm, ly.qk_eps);
      const torch::Tensor q = qkv.narrow(1, 0, Hq * D).view({T, Hq, D});
      const torch::Tensor k = qkv.narrow(1, Hq * D, Hkv * D).view({T, Hkv, D});
      const torch::Tensor v = qkv.narrow(1, (Hq + Hkv) * D, Hkv * D).view({T, Hkv, D});
      write_kv_(kv_caches[l], k, v, slot_mappings[g]);
      const torch::Tensor attn = paged_decode(q.contiguous(), kv_caches[l], block_tables[g], seq_lens[g], ly.scale,
                                              ly.window);
      x = x + ly.o(attn.reshape({T, Hq * D}));
      // MLP: GatedMLP.forward's fused path
      x = x + ly.down(silu_and_mul(ly.gate_up(rms_norm(x, ly.post_norm, ly.post_eps))));
    }
    return x;
  }

 private:
  int64_t Hq, Hkv, D;
  std::vector<Layer> layers;
};

inline void bind(py::module& m) {
  py::class_<Projection>(m, "Projection")
      .def(py::init<py::capsule, torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>, py::object,
                    int64_t>(),
           py::arg("kernel"), py::arg("a"), py::arg("b"), py::arg("bias"), py::arg("gemm") = py::none(),
           py::arg("gemm_rows") = 0);
  py::class_<Stack>(m, "DecodeStack")
      .def(py::init<int64_t, int64_t, int64_t>(), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"))
      .def("add_layer", &Stack::add_layer)
      .def("forward", &Stack::forward);
}

}  // namespace decode_stack
