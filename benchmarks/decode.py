"""Prefill and decode speed at batch 1: forwardpass vs Hugging Face transformers, same checkpoint, same run.

    python benchmarks/decode.py [--runs 3] [--prompt-len 128] [--new-tokens 64]

Creates a random Qwen3-0.6B-shaped checkpoint (28 layers, hidden 1024, 16 heads / 8 KV heads,
head_dim 128, vocab 151936, tied) on first use, then measures each engine several times and prints
medians, the ratio, and the memory roofline of this machine for fp32 decode (weight bytes / bandwidth).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import hf_generate_timer, median, qwen3_checkpoint, save


def bench_forwardpass(path, prompt, new_tokens, runs):
    from forwardpass import LLM, SamplingParams

    llm = LLM(path, max_model_len=1024, enable_prefix_caching=False, kv_cache_memory=512 << 20,
              cpu_kernels=True)
    params = SamplingParams(temperature=0, max_tokens=new_tokens + 1, ignore_eos=True)
    # warm-up
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    prefill, decode = [], []
    for _ in range(runs):
        llm.engine.stats.clear()
        llm.generate([prompt], params, use_tqdm=False)
        steps = list(llm.engine.stats)
        prefill.append(len(prompt) / steps[0].duration_s)
        dec = [s.duration_s for s in steps[1:] if s.num_decode_tokens]
        decode.append(len(dec) / sum(dec))
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())
    return median(prefill), median(decode), weight_bytes


def bench_transformers(path, prompt, new_tokens, runs):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    timed = hf_generate_timer(model, torch.tensor([prompt]))

    timed(4)  # warm-up
    prefill, decode = [], []
    for _ in range(runs):
        t1 = timed(1)
        tn = timed(new_tokens + 1)
        prefill.append(len(prompt) / t1)
        decode.append(new_tokens / (tn - t1))
    return median(prefill), median(decode)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--bandwidth-gbs", type=float, default=37.5,
                    help="measured read bandwidth of this machine")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    path = qwen3_checkpoint()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(1000, 100000, (args.prompt_len,), generator=gen).tolist()

    fp_pre, fp_dec, wbytes = bench_forwardpass(path, prompt, args.new_tokens, args.runs)
    roof = args.bandwidth_gbs * 1e9 / wbytes
    rows = [("forwardpass", fp_pre, fp_dec)]
    result = {"checkpoint": str(path), "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "runs": args.runs, "forwardpass": {"prefill_tok_s": fp_pre, "decode_tok_s": fp_dec},
              "weight_bytes": wbytes, "decode_roofline_tok_s": roof}
    if not args.skip_hf:
        hf_pre, hf_dec = bench_transformers(path, prompt, args.new_tokens, args.runs)
        rows.append(("transformers", hf_pre, hf_dec))
        result["transformers"] = {"prefill_tok_s": hf_pre, "decode_tok_s": hf_dec}
        result["ratio"] = {"prefill": fp_pre / hf_pre, "decode": fp_dec / hf_dec}
    print(f"\nQwen3-0.6B-shaped, fp32, batch 1, prompt {args.prompt_len}, {args.new_tokens} new tokens, "
          f"medians of {args.runs} runs")
    print(f"{'engine':<14}{'prefill tok/s':>15}{'decode tok/s':>15}")
    for name, p, d in rows:
        print(f"{name:<14}{p:>15.1f}{d:>15.2f}")
    if "ratio" in result:
        print(f"{'ratio':<14}{result['ratio']['prefill']:>14.2f}x{result['ratio']['decode']:>14.2f}x")
    print(f"decode roofline: {wbytes / 1e9:.2f} GB of weights / {args.bandwidth_gbs} GB/s = {roof:.1f} "
          f"tok/s; forwardpass reaches {fp_dec / roof:.0%} of it")
    print(f"saved {save('decode', result)}")


if __name__ == "__main__":
    main()
