"""What the batch-invariant plan costs: the same workloads through the default plan and
``batch_invariant=True``.

    python benchmarks/batch_invariance.py [--runs 5] [--quantization int8] [--model PATH]

Three workloads, each timed on both engines in turn (A B A B ..., ``--runs`` rounds), the ratio taken per
round and its median reported (a shared machine's drift hits both alike, as in ``benchmarks/peers.py``):

* prefill: one 512-token prompt, one token out (the plan's matmuls then run the small-batch kernel 64 rows at
  a time instead of oneDNN's GEMM, and every query's attention the paged kernel);
* decode: a 16-token prompt, 64 tokens out, alone (fp32: the same kernels; int8: the int8 kernel where the
  default takes AMX for 16+ rows, a difference only in the prefill here);
* batch: 32 requests of 128 prompt tokens and 64 out (a serving mix of both).

The model defaults to a random Qwen3 of 41M parameters (throughput.py's shape), written once with
save_pretrained; ``--model`` takes any dense Llama-family directory.
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import median, qwen3_checkpoint, save
from benchmarks.throughput import SHAPE


def workloads(vocab: int):
    rng = random.Random(0)
    ids = lambda n: {"prompt_token_ids": [rng.randrange(4, vocab) for _ in range(n)]}
    from forwardpass import SamplingParams

    out = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return {
        "prefill 512": ([ids(512)], [out(1)]),
        "decode b=1": ([ids(16)], [out(64)]),
        "batch 32x(128+64)": ([ids(128) for _ in range(32)], [out(64)] * 32),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--quantization", default=None, choices=[None, "int8", "int4"])
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    from forwardpass import LLM
    from forwardpass.kernel_build import cpu_flags

    model = args.model or str(qwen3_checkpoint("qwen3-41m-random", **SHAPE))
    common = {"quantization": args.quantization, "enable_prefix_caching": False, "cpu_kernels": True,
              "max_num_seqs": 32}
    engines = {name: LLM(model, batch_invariant=inv, **common) for name, inv in (("default", False),
                                                                                ("invariant", True))}
    vocab = engines["default"].engine.core.spec.vocab
    jobs = workloads(vocab)
    for llm in engines.values():  # warm-up: kernels, allocator, caches
        llm.generate(*jobs["batch 32x(128+64)"], use_tqdm=False)
    times: dict[str, dict[str, list[float]]] = {job: {e: [] for e in engines} for job in jobs}
    for _ in range(args.runs):
        for job, (prompts, params) in jobs.items():
            for name, llm in engines.items():
                t = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                times[job][name].append(time.perf_counter() - t)
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx512f", "avx512_vnni", "amx_tile", "avx2")))
    print(f"host: {platform.processor() or platform.machine()} {' '.join(flags)}; model {Path(model).name}; "
          f"weights {args.quantization or 'fp32'}; {args.runs} rounds, alternating")
    print(f"{'workload':<20} {'default s':>10} {'invariant s':>12} {'invariant/default':>18}  (per-round "
          "range)")
    rows = {}
    for job, t in times.items():
        ratios = [i / d for i, d in zip(t["invariant"], t["default"])]
        rows[job] = {"default_s": median(t["default"]), "invariant_s": median(t["invariant"]),
                     "ratio_median": median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
        r = rows[job]
        print(f"{job:<20} {r['default_s']:>10.3f} {r['invariant_s']:>12.3f} {r['ratio_median']:>17.2f}x  "
              f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f})")
    save(f"batch_invariance_{args.quantization or 'fp32'}",
         {"model": model, "runs": args.runs, "results": rows})


if __name__ == "__main__":
    main()
