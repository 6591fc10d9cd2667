"""The small-batch fp32 matmul kernel against the library GEMMs torch offers, on Qwen3-0.6B's shapes.

    python benchmarks/small_matmul.py [--threads 2] [--rows 1,4,16,32,64] [--rounds 5]

For each weight shape (q/k/v merged, o, gate/up merged, down, and the 151936-row LM head) and each batch
size: ``F.linear`` (MKL), oneDNN's ``_linear_pointwise`` on the plain weight (which it reorders every call)
and on the weight packed for it once, ours (``forwardpass/layers/csrc/small_matmul.cpp``) on the plain weight
and on those packed panels (what the engine runs, ``forwardpass/layers/packed.py``), alternated, best of
``--rounds``; prints time, the rate ours on panels reads the weight at (GB/s) and computes at (GFLOP/s), and
its speed over the best library path. The row count up
to which ours wins is ``forwardpass.layers.small_matmul.MAX_ROWS``. Weights of a few MB stay in the last-
level cache between calls, so their GB/s can exceed memory bandwidth; the LM head (622 MB) cannot.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from forwardpass.analysis.hardware import best_time

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
          "lm_head": (151936, 1024)}  # fmt: skip


def best_of(fn, calls: int) -> float:
    fn()  # warm-up
    return best_time(fn, calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4,16,32,64")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from forwardpass.layers.packed import PackedWeight
    from forwardpass.layers.small_matmul import host_isa, kernel_for

    module = kernel_for(host_isa()).load(logging.getLogger(__name__))
    ours = module.small_matmul
    paths = {
        "F.linear (MKL)": lambda x, w, pw: F.linear(x, w),
        "oneDNN": lambda x, w, pw: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
        "oneDNN packed": lambda x, w, pw: torch.ops.mkldnn._linear_pointwise(x, pw._onednn, None, "none", [],
                                                                             ""),
        "ours plain": lambda x, w, pw: ours(x, w),
        "ours": lambda x, w, pw: ours(x, pw.panels),
    }
    print(f"{args.threads} threads, {host_isa()} build")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k)
        pw = PackedWeight.pack(w, module)
        if pw is None:
            sys.exit("this oneDNN does not pack fp32 weights in 64-wide panels: the engine keeps them plain")
        gb = w.numel() * 4 / 1e9
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k)
            calls = 3 if gb > 0.1 else 20
            best = {p: best_of(lambda f=f, x=x, w=w, pw=pw: f(x, w, pw), calls) for p, f in paths.items()}
            for _ in range(args.rounds - 1):  # alternate the paths round by round
                for p, f in paths.items():
                    best[p] = min(best[p], best_of(lambda f=f, x=x, w=w, pw=pw: f(x, w, pw), calls))
            lib = min(v for p, v in best.items() if not p.startswith("ours"))
            cells = "  ".join(f"{p} {t * 1e3:7.2f} ms" for p, t in best.items())
            t = best["ours"]
            print(f"{name:8s} M={m:3d}  {cells}  ours {gb / t:5.1f} GB/s {2 * m * n * k / t / 1e9:6.1f} "
                  f"GFLOP/s  ours/library {lib / t:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
