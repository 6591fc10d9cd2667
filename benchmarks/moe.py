"""Decode speed of a Mixture-of-Experts model: forwardpass on a random Qwen3-MoE checkpoint vs a dense
Qwen3 with the same *active* parameter count, and vs Hugging Face transformers on the same MoE
checkpoint, all in one run.

    python benchmarks/moe.py [--runs 3] [--prompt-len 64] [--new-tokens 32] [--batch 1 8] [--skip-hf]
                             [--threads 1]

MoE: hidden 1024, 8 layers, 16 experts, top-2, moe_intermediate 768 (every layer sparse).
Dense: the same model with one MLP of width 2 × 768 = 1536, so each token touches as many weights.
At batch 1 decode is bound by the bytes of weights read per token, which are equal for the two; the
MoE reads 2/16 of its expert weights per token but its total size is ~5× larger. As the batch grows,
tokens spread over more experts and the MoE's bytes per step rise toward all experts.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import CACHE, hf_generate_timer, median, save

SHAPE = {
    "vocab_size": 32000, "hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "rope_theta": 1e6, "bos_token_id": 1, "eos_token_id": 2,
}
MOE = {"num_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 768, "norm_topk_prob": True,
           "intermediate_size": 1536, "decoder_sparse_step": 1}


def checkpoint(kind: str) -> Path:
    path = CACHE / f"{kind}-h1024-l8-random"
    if (path / "model.safetensors").exists() or (path / "model.safetensors.index.json").exists():
        return path
    import transformers

    if kind == "moe":
        cfg, cls = transformers.Qwen3MoeConfig(**SHAPE, **MOE), transformers.Qwen3MoeForCausalLM
    else:
        cfg, cls = transformers.Qwen3Config(**SHAPE, intermediate_size=2 * MOE["moe_intermediate_size"]), \
            transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    t = time.perf_counter()
    with torch.no_grad():
        model = cls(cfg).eval()
    model.save_pretrained(path)
    print(f"created {path} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params) "
          f"in {time.perf_counter() - t:.0f}s")
    return path


def active_params(spec) -> int:
    """Weights one decode token reads: attention + embeddings/LM head + the chosen experts (+ routers)."""
    h = spec.hidden
    moe_mlp = spec.moe.experts_per_tok * spec.expert_params + h * spec.moe.num_experts
    dense_mlp = 3 * h * spec.intermediate
    return (spec.layers * spec.attention_params + spec.moe_layers * moe_mlp + spec.dense_layers * dense_mlp
            + spec.vocab * h)


def bench_forwardpass(path, prompts, new_tokens, runs):
    from forwardpass import LLM, SamplingParams

    llm = LLM(path, max_model_len=1024, enable_prefix_caching=False, kv_cache_memory=256 << 20,
              cpu_kernels=True)
    params = SamplingParams(temperature=0, max_tokens=new_tokens + 1, ignore_eos=True)
    # warm-up
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    rates = []
    for _ in range(runs):
        llm.engine.stats.clear()
        llm.generate(prompts, params, use_tqdm=False)
        dec = [s for s in llm.engine.stats
               if s.num_decode_tokens == len(prompts) and not s.num_prefill_tokens]
        rates.append(sum(s.num_decode_tokens for s in dec) / sum(s.duration_s for s in dec))
    model = llm.engine.model
    total = sum(p.numel() for p in model.parameters())
    routing = None
    if llm.engine.routing_stats is not None:
        used = [sum(1 for c in counts if c) for r in llm.engine.routing_stats if r.num_tokens == len(prompts)
                for counts in r.tokens_per_expert]
        routing = {"mean_experts_used_per_layer_per_decode_step": sum(used) / max(len(used), 1)}
    return median(rates), total, active_params(model.spec), routing


def bench_transformers(path, prompts, new_tokens, runs):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    timed = hf_generate_timer(model, torch.tensor(prompts))

    timed(2)  # warm-up
    rates = []
    for _ in range(runs):
        t1 = timed(1)
        tn = timed(new_tokens + 1)
        rates.append(len(prompts) * new_tokens / (tn - t1))
    return median(rates)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--bandwidth-gbs", type=float, default=37.5,
                    help="measured read bandwidth of this machine")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (on a shared, overloaded machine 1 thread avoids OpenMP barrier "
                         "stalls that make 2-thread matmuls 10-100x slower)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    paths = {"moe": checkpoint("moe"), "dense": checkpoint("dense")}
    g = torch.Generator().manual_seed(0)
    result = {"shape": SHAPE, "moe": MOE, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "runs": args.runs, "threads": torch.get_num_threads(), "batches": {}}
    rows = []
    for batch in args.batch:
        prompts = torch.randint(3, SHAPE["vocab_size"], (batch, args.prompt_len), generator=g).tolist()
        entry = {}
        for kind, path in paths.items():
            rate, total, active, routing = bench_forwardpass(path, prompts, args.new_tokens, args.runs)
            entry[f"forwardpass_{kind}"] = {"decode_tok_s": rate, "total_params": total,
                                            "active_params": active,
                                            "roofline_tok_s": batch * args.bandwidth_gbs * 1e9 / (4 * active)
                                            if batch == 1 else None,
                                            **({"routing": routing} if routing else {})}
            rows.append((batch, f"forwardpass {kind}", rate, total, active))
        if not args.skip_hf:
            for kind in ("moe", "dense"):
                rate = bench_transformers(paths[kind], prompts, args.new_tokens, args.runs)
                entry[f"transformers_{kind}"] = {"decode_tok_s": rate}
                rows.append((batch, f"transformers {kind}", rate, None, None))
        fm, fd = entry["forwardpass_moe"]["decode_tok_s"], entry["forwardpass_dense"]["decode_tok_s"]
        entry["ratio_moe_vs_dense"] = fm / fd
        if "transformers_moe" in entry:
            entry["ratio_vs_transformers_moe"] = fm / entry["transformers_moe"]["decode_tok_s"]
        result["batches"][str(batch)] = entry

    print(f"\nQwen3-MoE (16 experts, top-2) vs dense Qwen3 of equal active size, fp32, decode, "
          f"prompt {args.prompt_len}, {args.new_tokens} new tokens, medians of {args.runs} runs")
    print(f"{'batch':>5}  {'engine':<20}{'decode tok/s':>14}{'params':>10}{'active':>10}")
    for batch, name, rate, total, active in rows:
        tp = f"{total / 1e6:.0f}M" if total else ""
        ap_ = f"{active / 1e6:.0f}M" if active else ""
        print(f"{batch:>5}  {name:<20}{rate:>14.2f}{tp:>10}{ap_:>10}")
    for batch, entry in result["batches"].items():
        line = f"batch {batch}: MoE / dense (forwardpass) = {entry['ratio_moe_vs_dense']:.2f}x"
        if "ratio_vs_transformers_moe" in entry:
            line += f"; forwardpass / transformers on the MoE = {entry['ratio_vs_transformers_moe']:.2f}x"
        print(line)
    print(f"saved {save('moe', result)}")


if __name__ == "__main__":
    main()
