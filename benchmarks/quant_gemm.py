"""Quantized matmuls at every batch size, against the machine's roofs and against the float GEMM of the
dequantized weight: the numbers behind each weight type's choice of path (``quant/weight.py``,
``quant/kblock_weight.py``).

python benchmarks/quant_gemm.py [--threads 2] [--rows 1,2,4,8,16,32,64,256,1024] [--types Q4_1,Q4_K,...]
[--shape 2048x2048] [--rounds 5]

For each GGUF weight type (Q8_0 and Q4_0 on the quantized-matmul kernel, our int8 / int4; the others on the
K-block kernel), random blocks of one matrix shape, and each row count: the path the engine takes
(``weight.matmul``), oneDNN's fp32 GEMM on the dequantized weight (``dense_matmul(x, W)``: what the engine
would do without its kernel) and, where the CPU multiplies bf16 in hardware, oneDNN's bf16 GEMM. Alternated,
medians of ``--rounds``; GOP/s (2·M·N·K per second) and the engine's share of two roofs measured in the same
run: the fp32 GEMM rate (2048³, the faster of MKL and oneDNN) and the int8 dot-product rate of this core type
(a loop of independent ``maddubs`` accumulated in int16, the AVX2 kernels' inner loop; the roof of the AVX2
builds, also on wider CPUs). The last column says how much faster the engine's path is than the best float
GEMM there."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import save  # noqa: E402

INT8_ROOF_SRC = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <ATen/Parallel.h>
// Ops/s of int8 dot products: 8 independent chains of maddubs (32 u8 x s8 products, pairs added into int16)
// and an int16 add, the AVX2 kernels' inner loop (they widen with one madd per block, not counted here); 2
// ops (multiply, add) per product.
double int8_roof(int64_t iters) {
  double total = 0;
  const auto t0 = std::chrono::steady_clock::now();
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(5);
    __m256i acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_si256();
    for (int64_t it = 0; it < iters; ++it)
      for (int i = 0; i < 8; ++i) {
        acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(a, b));
        asm("" : "+x"(acc[i]));
      }
    int32_t out[8];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), acc[0]);
    if (out[0] == 42) printf("!");
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  total = 2.0 * 32 * 8 * iters * at::get_num_threads();
  return total / s;
}
"""


def int8_roof() -> float | None:
    """The int8 dot-product roof of this machine (ops/s, all threads), or None without a compiler."""
    try:
        from torch.utils.cpp_extension import load_inline

        mod = load_inline("fp_int8_roof", cpp_sources=INT8_ROOF_SRC, functions=["int8_roof"],
                          extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"])
        mod.int8_roof(1 << 18)
        return max(mod.int8_roof(1 << 22) for _ in range(3))
    except Exception as exc:  # noqa: BLE001 - the roof is a reference line, not the measurement
        print(f"(no int8 roof: {exc})")
        return None


def fp32_roof() -> float:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    best = 0.0
    for fn in (lambda: a @ b, lambda: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")):
        fn()
        for _ in range(3):
            t = time.perf_counter()
            fn()
            best = max(best, 2 * 2048**3 / (time.perf_counter() - t))
    return best


def make_weight(kind: str, n: int, k: int):
    """A random ``kind`` matrix as the engine holds it (QuantizedWeight or KBlockWeight)."""
    from forwardpass.quant import gguf_blocks, kblocks
    from forwardpass.quant.formats import quantize
    from forwardpass.quant.kblock_weight import KBlockWeight
    from forwardpass.quant.weight import QuantizedWeight

    if kind in ("Q8_0", "Q4_0"):
        w = torch.randn(n, k) * 0.02
        qs, d = quantize(w, kind.lower())
        return QuantizedWeight(qs, d, kind.lower(), k)
    from tests.test_gguf_blocks import random_blocks  # every bit pattern, fp16 fields kept finite

    spec = kblocks.KINDS[kind.lower()]
    blocks = torch.from_numpy(random_blocks(kind, n, k, 0))
    codes, meta = kblocks.pack(spec, gguf_blocks.unpack(kind, blocks, k))
    return KBlockWeight(spec, codes, meta)


def median_rate(fn, flops: float, budget_s: float = 0.15) -> float:
    fn()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < budget_s:
        fn()
        n += 1
    return flops * n / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,2,4,8,16,32,64,256,1024")
    p.add_argument("--types", default="Q8_0,Q4_0,Q4_1,Q5_0,Q5_1,Q2_K,Q3_K,Q4_K,Q5_K,Q6_K")
    p.add_argument("--shape", default="2048x2048",
                   help="N x K of the matrix (default: a 1B Llama's q/o projection; K-quants need "
                   "K % 256 == 0)")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from forwardpass.kernel_build import cpu_flags
    from forwardpass.layers.dense_matmul import dense_matmul

    n, k = (int(v) for v in args.shape.lower().split("x"))
    bf16 = bool({"amx_bf16", "avx512_bf16"} & cpu_flags())
    roofs = {"fp32 GEMM": fp32_roof(), "int8 dot products": int8_roof()}
    roof_words = ", ".join(f"{name} {r / 1e9:.0f} GOP/s" for name, r in roofs.items() if r)
    print(f"{args.threads} threads; roofs: {roof_words}")
    rows_out = []
    for kind in args.types.split(","):
        w = make_weight(kind, n, k)
        deq = w.dequantize() if hasattr(w, "dequantize") else None
        deq_bf16 = deq.to(torch.bfloat16) if bf16 and deq is not None else None
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k)
            xb = x.to(torch.bfloat16)
            # default arguments bind this iteration's weight and activations
            paths = {"engine": lambda w=w, x=x: w.matmul(x),
                     "fp32 oneDNN": lambda x=x, deq=deq: dense_matmul(x, deq)}
            if deq_bf16 is not None:
                paths["bf16 oneDNN"] = lambda xb=xb, deq_bf16=deq_bf16: dense_matmul(xb, deq_bf16)
            flops = 2.0 * m * n * k
            rates: dict[str, list[float]] = {name: [] for name in paths}
            for _ in range(args.rounds):
                for name, fn in paths.items():
                    rates[name].append(median_rate(fn, flops))
            med = {name: statistics.median(r) for name, r in rates.items()}
            best_other = max(v for name, v in med.items() if name != "engine")
            row = {"type": kind, "rows": m, **{f"{name} GOP/s": v / 1e9 for name, v in med.items()},
                   "engine / best other": med["engine"] / best_other,
                   **{f"engine % of {name}": 100 * med["engine"] / r for name, r in roofs.items() if r}}
            rows_out.append(row)
            print(f"{kind:5s} M={m:5d}  " + "  ".join(f"{name} {v / 1e9:6.1f}" for name, v in med.items())
                  + f"  GOP/s   engine/other {med['engine'] / best_other:4.2f}  "
                  + "  ".join(f"{100 * med['engine'] / r:4.0f}% of {name}" for name, r in roofs.items() if r))
    out = save("quant_gemm", {"shape": [n, k], "threads": args.threads,
                              "roofs": {name: r for name, r in roofs.items()}, "rows": rows_out})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
