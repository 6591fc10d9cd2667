"""bf16 weights in the small-batch kernel's panels (``forwardpass/layers/half_panels.py``) against the fp32
path the engine takes for the same values (``layers/packed.py``: our kernel on oneDNN's panels up to
``MAX_ROWS`` rows, oneDNN's GEMM above), on the projection shapes of SmolLM2-135M and of a 1B Llama.

    python benchmarks/half_panels.py [--threads 2] [--rows 1,4,16,32,64,256,512] [--reps 9]

For each shape and row count the two are called alternately, ``--reps`` times each after a warm-up; prints
the medians, the GFLOP/s of each and fp32 time / bf16 time (above 1: the bf16 panels are faster). One row
reads the weight from memory (half the bytes); from a few rows on both are bound by the FMA rate.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from forwardpass.layers import small_matmul as sm
from forwardpass.layers.half_panels import HalfPanelWeight
from forwardpass.layers.packed import PackedWeight

#: (N, K): SmolLM2-135M's q/k/v merged, gate/up merged and down; the 1B Llama's q/k/v, gate/up and down
SHAPES = [(960, 576), (3072, 576), (576, 1536), (2560, 2048), (11264, 2048), (2048, 5632)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4,16,32,64,256,512")
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    module = sm.kernel_for(sm.host_isa()).load(logging.getLogger(__name__))
    print(f"small-batch kernel build {sm.host_isa()}, {args.threads} threads; medians of {args.reps}")
    for n, k in SHAPES:
        w = torch.randn(n, k).to(torch.bfloat16).float()  # values both hold exactly
        fp32, half = PackedWeight.pack(w, module), HalfPanelWeight.pack(w, torch.bfloat16, module)
        if fp32 is None or half is None:
            print(f"N={n} K={k}: not packed here, skipped")
            continue
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k)
            times: dict[str, list[float]] = {"fp32": [], "bf16": []}
            for weight in (fp32, half):
                weight.matmul(x)  # warm-up
            for _ in range(args.reps):
                for name, weight in (("fp32", fp32), ("bf16", half)):
                    t0 = time.perf_counter()
                    weight.matmul(x)
                    times[name].append(time.perf_counter() - t0)
            a, b = statistics.median(times["fp32"]), statistics.median(times["bf16"])
            flop = 2 * m * n * k
            print(f"N={n:5d} K={k:4d} rows={m:3d}  fp32 {a * 1e3:8.3f} ms {flop / a / 1e9:6.1f} GFLOP/s   "
                  f"bf16 {b * 1e3:8.3f} ms {flop / b / 1e9:6.1f} GFLOP/s   fp32/bf16 {a / b:.2f}", flush=True)


if __name__ == "__main__":
    main()
