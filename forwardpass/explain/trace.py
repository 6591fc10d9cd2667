"""Run one request through the engine and assemble the explanation (one JSON-ready dict).

The engine part is the real thing: an ``LLMEngine`` runs the request; after each step the engine core's
``StepRecord`` gives the tokens it computed, its time, FLOPs and bytes and the KV blocks in use, and the
request's output gives the token drawn. KV entries after a step are the tokens whose K/V the engine has
computed (or found in the prefix cache) so far: the prompt length after prefill, then one more per
decode step. Everything else is computed afterwards from the request's tokens (``views.py``, ``funnel.py``)
and checked against the run: each funnel re-draws its token and must get the engine's.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch

from forwardpass.engine.scheduling.stats import StepRecord
from forwardpass.explain.batching import batching_sweep
from forwardpass.explain.cost import step_cost
from forwardpass.explain.funnel import sampling_funnel
from forwardpass.explain.speculation import speculation_steps
from forwardpass.explain.views import layer_views
from forwardpass.layers.weight_report import described_plan
from forwardpass.sampling.params import SamplingParams
from forwardpass.sampling.sampler import make_generator

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _pieces(tok: Any, ids: list[int]) -> list[dict[str, Any]]:
    """Each prompt token with its vocabulary piece and text; pieces of one word share ``word``."""
    out: list[dict[str, Any]] = []
    word = -1
    for i, t in enumerate(ids):
        piece = tok.id_to_token(t) if tok is not None else None
        text = tok.decode([t], skip_special_tokens=False) if tok is not None else str(t)
        starts = (i == 0 or not text or text[0].isspace()
                  or not (text[0].isalnum() and out[-1]["text"][-1:].isalnum()))
        word += starts
        out.append({"id": t, "text": text, "piece": piece, "word": word})
    sizes: dict[int, int] = {}
    for e in out:
        sizes[e["word"]] = sizes.get(e["word"], 0) + 1
    for e in out:
        e["split"] = sizes[e["word"]] > 1  # the word is made of several tokens
    return out


def _params(engine: Any, max_tokens: int, seed: int | None, ignore_eos: bool,
            **overrides: Any) -> SamplingParams:
    base = engine.default_sampling_params()
    kw = {k: getattr(base, k) for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")}
    kw.update({k: v for k, v in overrides.items() if v is not None})
    return SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=ignore_eos, **kw)


def explain(
    prompt: str | list[int],
    *,
    model: str | Path | None = None,
    engine: Any = None,
    max_tokens: int = 8,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    seed: int | None = 0,
    ignore_eos: bool = False,
    layer: int | None = None,
    head: int = 0,
    hardware: Any = "this-machine",
    overhead: Any = "this-machine",
    dtype: str = "auto",
    device: str = "cpu",
    speculative_config: dict[str, Any] | None = None,
    batch_sizes: tuple[int, ...] = (),
) -> dict[str, Any]:
    """Run ``prompt`` once and explain it; see ``docs/explain.md`` for the fields.

    ``seed`` defaults to 0 so that the run can be reproduced (and each draw verified); ``hardware`` is a name
    for :func:`forwardpass.analysis.hardware.get_hardware`, a ``Hardware`` or None (no roofline prediction);
    ``overhead`` an :class:`~forwardpass.analysis.overhead.Overhead`, ``"this-machine"`` (measured once,
    cached) or None. ``batch_sizes``: afterwards, the prompt decoded beside copies of itself at each of these
    batch sizes (``batching.py``: FLOP/s and bytes/s against the roofs as the batch grows)."""
    if engine is None:
        from forwardpass.config import EngineConfig
        from forwardpass.engine.frontend.llm_engine import LLMEngine
        from forwardpass.registry import resolve_model

        engine = LLMEngine(str(resolve_model(str(model) if model else None)),
                           EngineConfig(dtype=dtype, device=device, speculative_config=speculative_config))
    core, tok, spec = engine.core, engine.tokenizer, engine.spec
    params = _params(engine, max_tokens, seed, ignore_eos, temperature=temperature, top_k=top_k,
                     top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty)
    prompt_ids = engine.encode_prompt(prompt)
    hw = oh = None
    dtype_name = _DTYPE_NAMES.get(core.config.torch_dtype, "fp32")
    if hardware is not None:
        from forwardpass.analysis.hardware import get_hardware

        hw = get_hardware(hardware)
    if overhead == "this-machine":
        from forwardpass.analysis.overhead import this_machine_overhead

        oh = this_machine_overhead(core.config.device.split(":")[0])
    elif overhead is not None:
        oh = overhead

    # ----- the real run ----------------------------------------------------------------------------
    if engine.has_unfinished_requests():  # every step record must be this request's alone
        from forwardpass.errors import ValidationError

        raise ValidationError("explain needs an idle engine: it reads the engine's step records as its own")
    rid = f"explain-{time.monotonic_ns()}"
    engine.add_request(rid, prompt_ids, params)
    steps: list[tuple[StepRecord, list[int]]] = []
    cpu: list[tuple[float, float]] = []  # the process's CPU and wall seconds over each step
    generated: list[int] = []
    try:
        while engine.has_unfinished_requests():
            wall0, cpu0 = time.perf_counter(), time.process_time()
            outs = engine.step()
            cpu.append((time.process_time() - cpu0, time.perf_counter() - wall0))
            for out in outs:
                if out.request_id == rid:
                    generated = list(out.outputs[0].token_ids)
            steps.append((core.stats[-1], list(generated)))
    finally:
        engine.abort(rid)

    text = (lambda t: tok.decode([t], skip_special_tokens=False)) if tok is not None else str
    bs = core.config.block_size
    layers = spec.layers
    kv_entries = 0
    hits_before = 0
    prefill_records: list[StepRecord] = []
    decode: list[dict[str, Any]] = []
    prefill: dict[str, Any] = {}
    n_seen = 0
    prefill_cpu = [0.0, 0.0]
    for (rec, gen), (cpu_s, wall_s) in zip(steps, cpu):
        kv_entries += rec.num_prefill_tokens + rec.num_decode_tokens + (rec.prefix_cache_hits - hits_before)
        hits_before = rec.prefix_cache_hits
        new = gen[n_seen:]
        n_seen = len(gen)
        if not prefill:
            prefill_records.append(rec)
            prefill_cpu = [prefill_cpu[0] + cpu_s, prefill_cpu[1] + wall_s]
            if new:  # the step that finished the prompt drew the first token
                prefill = {"tokens": len(prompt_ids), "steps": len(prefill_records), "kv_entries": kv_entries,
                           "kv_blocks": math.ceil(kv_entries / bs), "token": new[0], "text": text(new[0]),
                           **step_cost(prefill_records, layers, hw, dtype_name, oh, tuple(prefill_cpu))}
            continue
        for t in new:
            decode.append({"step": len(decode) + 1, "engine_step": rec.step, "token": t, "text": text(t),
                           "kv_entries": kv_entries,
                           "kv_blocks": math.ceil(kv_entries / bs),
                           "kv_blocks_in_pool": core.kv.num_blocks - rec.num_free_blocks,
                           **step_cost([rec], layers, hw, dtype_name, oh, (cpu_s, wall_s))})

    # ----- views outside the engine, checked against the run ---------------------------------------
    engine_routing: dict[int, list[int]] = {}  # the engine's own counts over this request's steps
    if core.routing_stats is not None:
        ours = {rec.step for rec, _ in steps}
        for rr in (r for r in core.routing_stats if r.step in ours):
            for lyr, counts in zip(rr.layers, rr.tokens_per_expert):
                acc = engine_routing.setdefault(lyr, [0] * len(counts))
                engine_routing[lyr] = [a + c for a, c in zip(acc, counts)]
    P, N = len(prompt_ids), len(generated)
    seq = prompt_ids + generated[:-1]
    views = layer_views(core.model, seq, list(range(P - 1, P + N - 1)), layer=layer, head=head)
    gen_ = make_generator(params.seed, 0) if params.seed is not None else None
    funnels = []
    for i in range(N):
        f = sampling_funnel(views.logits[i], params, prompt_ids, generated[:i], gen_, core.eos_token_ids,
                            text)
        funnels.append({**f.to_dict(), "redrawn": f.drawn, "verified": f.drawn == generated[i]
                        if params.seed is not None or params.greedy else None})
    if prefill:
        prefill.update(funnels[0])
    for d, f in zip(decode, funnels[1:]):
        d.update(f)

    for r in views.routing:  # the views' routing, counted the engine's way, against the engine's counts
        counts = [0] * r["num_experts"]
        for experts in r["experts"]:
            for e in experts:
                counts[e] += 1
        r["tokens_per_expert"] = counts
        r["engine_tokens_per_expert"] = engine_routing.get(r["layer"])
        r["matches_engine"] = r["engine_tokens_per_expert"] == counts
    names = ["embedding", *(f"layer {i}" for i in range(layers))]
    roofline: dict[str, Any] = {"dtype": dtype_name, "overhead": oh.to_dict() if oh is not None else None,
                                "hardware": hw.to_dict(dtype_name) if hw is not None else None, "points": []}
    for stage, items in (("prefill", [prefill] if prefill else []), ("decode", decode)):
        for d in items:
            roofline["points"].append({"stage": stage, "step": d.get("step", 0), "intensity": d["intensity"],
                                       "achieved_flops_per_s": d["achieved_flops_per_s"],
                                       "predicted_flops_per_s": d["flops"] / d["predicted_s"]
                                       if d.get("predicted_s") else None, "bound": d["bound"],
                                       "regime": d.get("regime")})
    return {
        "model": spec.name or str(engine.model_dir),
        "architecture": spec.architecture,
        "prompt": prompt if isinstance(prompt, str) else None,
        "params": {"max_tokens": max_tokens, "temperature": params.temperature, "top_k": params.top_k,
                   "top_p": params.top_p, "min_p": params.min_p,
                   "repetition_penalty": params.repetition_penalty, "seed": params.seed},
        "engine": {"block_size": bs, "num_kv_blocks": core.kv.num_blocks, "dtype": dtype_name,
                   "device": core.config.device, "layers": layers, "heads": spec.heads,
                   "kv_heads": spec.kv_heads},
        # how the engine that ran the request computes (forwardpass/plan.py)
        "execution_plan": described_plan(core.plan, core.model),
        "tokens": _pieces(tok, prompt_ids),
        "generated": [{"id": t, "text": text(t)} for t in generated],
        "completion": tok.decode(generated) if tok is not None else None,
        "prefill": prefill,
        "decode": decode,
        "layers": [{"name": n, "norms": norms, "mean_norm": sum(norms) / len(norms)}
                   for n, norms in zip(names, views.norms)],
        "sequence": [{"id": t, "text": text(t)} for t in seq],
        "attention": {"layer": views.attention_layer, "head": views.attention_head,
                      "weights": views.attention}
        if views.attention else None,
        "routing": views.routing,
        "roofline": roofline,
        "speculation": speculation_steps(steps, text),  # drafts proposed / accepted / rejected per step
        "verified": all(f["verified"] is not False for f in funnels),
        # batching raises arithmetic intensity: decode steps of the prompt beside copies of itself
        "batching": batching_sweep(engine, prompt_ids, batch_sizes, hw=hw, dtype_name=dtype_name, overhead=oh)
        if batch_sizes else None,
    }
