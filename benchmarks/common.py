"""Shared benchmark helpers: checkpoints built on the spot, medians, JSON results."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

CACHE = Path(os.environ.get("FORWARDPASS_BENCH_CACHE", Path(__file__).parent / ".cache"))
# Runs write to benchmarks/results/local/ (gitignored), so a local run never overwrites the committed
# figures; FORWARDPASS_BENCH_RECORD=1 writes benchmarks/results/ itself (to record new official numbers).
RESULTS = Path(__file__).parent / "results" / (
    "" if os.environ.get("FORWARDPASS_BENCH_RECORD") == "1" else "local")

QWEN3_06B = {
    "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "rope_theta": 1000000.0, "bos_token_id": 151643,
    "eos_token_id": 151645,
}


def qwen3_checkpoint(name: str = "qwen3-0.6b-random", **overrides) -> Path:
    """A random-weight Qwen3 checkpoint (0.6B shapes by default), written once with save_pretrained."""
    path = CACHE / name
    if (path / "model.safetensors").exists() or (path / "model.safetensors.index.json").exists():
        return path
    import transformers

    cfg = transformers.Qwen3Config(**{**QWEN3_06B, **overrides})
    torch.manual_seed(0)
    t = time.perf_counter()
    with torch.no_grad():
        model = transformers.Qwen3ForCausalLM(cfg).eval()
    model.save_pretrained(path)
    print(f"created {path} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params) "
          f"in {time.perf_counter() - t:.0f}s")
    del model
    return path


def hf_generate_timer(model, ids: torch.Tensor):
    """``timed(n)``: seconds transformers ``generate`` takes for exactly ``n`` greedy tokens per row of
    ``ids`` (equal-length rows, so no padding; EOS ignored, like ``ignore_eos=True`` on our side)."""
    kw = {"attention_mask": torch.ones_like(ids), "do_sample": False, "eos_token_id": None, "pad_token_id": 0}

    def timed(n: int) -> float:
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        return time.perf_counter() - t

    return timed


def median(xs):
    return statistics.median(xs)


def save(name: str, data: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    data = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                        "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M")}, **data}
    out = RESULTS / f"{name}.json"
    out.write_text(json.dumps(data, indent=2))
    return out
