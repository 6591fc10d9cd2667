"""Sampler micro-benchmark: one decode step's sampling over a [64, 151936] batch, in ms.

    python benchmarks/sampler.py [--device cuda] [--batch 64] [--vocab 151936]

Two kinds of logits: "peaked" (a few dozen likely tokens, like a trained LM; the top-p 0.9 nucleus
fits in the sampler's candidates) and "flat" (randn * 2, like a random-weight model; the nucleus holds
thousands of tokens, so top-p rows fall back to a full sort). Writes
benchmarks/results/local/sampler-DEVICE.json (benchmarks/results/ with FORWARDPASS_BENCH_RECORD=1).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from forwardpass.sampling import SamplingParams
from forwardpass.sampling.sampler import Sampler, SamplingRow, make_generator


def make_logits(kind: str, batch: int, vocab: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, vocab, generator=gen) * 2
    if kind == "peaked":
        logits *= 0.75
        hot = torch.randint(0, vocab, (batch, 40), generator=gen)
        logits.scatter_(1, hot, 12 + 2 * torch.randn(batch, 40, generator=gen))
    return logits.to(device)


def scenarios(batch: int) -> dict[str, list[SamplingRow]]:
    def rows(make):
        return [make(i) for i in range(batch)]

    def mixed(i: int) -> SamplingRow:
        out = [(i * 7919 + j * 104729) % 151936 for j in range(64)]
        kind = i % 4
        if kind == 0:
            return SamplingRow(SamplingParams(temperature=0), list(range(512)), out)
        if kind == 1:
            return SamplingRow(SamplingParams(temperature=0.8, seed=i), [], out, make_generator(i))
        if kind == 2:
            return SamplingRow(
                SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=i), [], out, make_generator(i)
            )
        p = SamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=1.1, presence_penalty=0.5, seed=i)
        return SamplingRow(p, list(range(512)), out, make_generator(i))

    return {
        "all greedy": rows(lambda i: SamplingRow(SamplingParams(temperature=0), [], [])),
        "all temperature 0.8": rows(lambda i: SamplingRow(SamplingParams(temperature=0.8), [], [])),
        "all top-p 0.9 + temperature 0.8": rows(
            lambda i: SamplingRow(SamplingParams(temperature=0.8, top_p=0.9), [], [])
        ),
        "all top-k 50 + temperature 0.8": rows(
            lambda i: SamplingRow(SamplingParams(temperature=0.8, top_k=50), [], [])
        ),
        "mixed with seeds + penalties": rows(mixed),
    }


def time_ms(fn, device: str, repeats: int) -> float:
    fn()  # warm-up (workspace allocation)
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    sampler = Sampler()
    results: dict[str, dict[str, float]] = {}
    for kind in ("peaked", "flat"):
        logits = make_logits(kind, args.batch, args.vocab, args.device)
        results[kind] = {}
        for name, rows in scenarios(args.batch).items():
            ms = time_ms(lambda x=logits, r=rows: sampler(x, r), args.device, args.repeats)
            results[kind][name] = round(ms, 2)
            print(f"{kind:7s} {name:36s} {ms:9.2f} ms")
        results[kind]["reference: argmax"] = round(
            time_ms(lambda x=logits: x.argmax(-1), args.device, args.repeats), 2
        )
        print(f"{kind:7s} {'reference: argmax':36s} {results[kind]['reference: argmax']:9.2f} ms")
    from benchmarks.common import RESULTS

    out = RESULTS / f"sampler-{args.device.split(':')[0]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": args.device,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "batch": args.batch,
        "vocab": args.vocab,
    }
    out.write_text(json.dumps({"machine": meta, "ms": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
