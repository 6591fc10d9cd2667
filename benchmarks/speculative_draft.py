"""The embedded model with its shipped draft (``forwardpass-default-draft``) against plain decoding.

    python -m benchmarks.speculative --method draft_model -k 3 --threads 1 [--always]
        [--draft-quantization auto,none] [--max-tokens 64] [--rounds 1]

On the embedded model's own held-out text. Batch 1, greedy, same run, alternating: each prompt (a passage of
the held-out Austen text, never seen in training by either model, at ``HELDOUT_OFFSETS``) runs once on each
engine, plain and one per draft quantization (``speculative_config.quantization``), in an order that rotates
from prompt to prompt. The decode time counts every step after the prefill, the draft's own forward passes
included (they run in ``schedule()``, inside the step); the CPU time is the thread's over the whole request
(prefill too), which a loaded host inflates less than wall time. Printed per draft: tokens/s both ways, the
ratio of the totals and the per-prompt paired median with its range (wall and CPU), the draft acceptance rate,
tokens per target weight read (generated tokens / target forward passes), the draft's share of the decode time
and one draft pass against one plain decode step, and the target's verify cost (a forward of ``1 + k`` decode
rows against one row). ``--always``: propose ``k`` drafts every step (the adaptive policy off).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from forwardpass import LLM, SamplingParams
from forwardpass.assets import default_llm_heldout_text_path

#: character offsets of the prompts in the held-out text (spread over all six novels' held-out parts)
HELDOUT_OFFSETS = tuple(range(2_000, 195_000, 9_600))  # 21 prompts
PROMPT_CHARS = 400


def heldout_prompts() -> list[str]:
    text = default_llm_heldout_text_path().read_text(encoding="utf-8")
    prompts = []
    for off in HELDOUT_OFFSETS:
        start = text.index(" ", off) + 1  # start and end at word boundaries
        end = text.rindex(" ", start, start + PROMPT_CHARS)
        prompts.append(text[start:end])
    return prompts


@dataclass
class Run:
    """One request on one engine."""

    tokens: list[int]
    decode_s: float  # wall: the steps after the prefill's, each step's own duration
    cpu_s: float  # the thread's CPU time over the whole request
    steps: int  # decode steps = target forward passes after the prefill
    drafts: int = 0
    accepted: int = 0
    draft_passes: int = 0
    drafting_s: float = 0.0


def decode_run(llm: LLM, prompt: str, params: SamplingParams) -> Run:
    speculator = llm.engine.core.scheduler.speculator
    proposer = speculator.proposer if speculator is not None else None
    passes0, seconds0 = (proposer.num_forwards, proposer.seconds_drafting) if proposer else (0, 0.0)
    llm.engine.stats.clear()
    c0 = time.thread_time()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    cpu = time.thread_time() - c0
    steps = [r for r in llm.engine.stats if not r.num_prefill_tokens]
    run = Run(list(out.outputs[0].token_ids), sum(r.duration_s for r in steps), cpu, len(steps),
              out.metrics.num_draft_tokens, out.metrics.num_accepted_tokens)
    if proposer is not None:
        run.draft_passes = proposer.num_forwards - passes0
        run.drafting_s = proposer.seconds_drafting - seconds0
    return run


def paired(a: list[Run], b: list[Run], attr: str) -> tuple[float, float, float]:
    """Median, min and max over prompts of b's time / a's time (a's speedup over b) for ``attr``."""
    ratios = [getattr(y, attr) / getattr(x, attr) for x, y in zip(a, b) if getattr(x, attr) > 0]
    return statistics.median(ratios), min(ratios), max(ratios)


def summary(label: str, runs: list[Run], plain: list[Run], k: int) -> dict:
    tokens = sum(len(r.tokens) - 1 for r in runs)  # the first token comes from the prefill step
    decode_s, cpu_s = sum(r.decode_s for r in runs), sum(r.cpu_s for r in runs)
    plain_decode_s, plain_steps = sum(r.decode_s for r in plain), sum(r.steps for r in plain)
    drafts, accepted = sum(r.drafts for r in runs), sum(r.accepted for r in runs)
    draft_passes, drafting_s = sum(r.draft_passes for r in runs), sum(r.drafting_s for r in runs)
    res = {"label": label, "k": k, "tokens": tokens, "decode_s": decode_s, "cpu_s": cpu_s,
           "tok_s": tokens / decode_s, "steps": sum(r.steps for r in runs),
           "drafts": drafts, "accepted": accepted, "acceptance_rate": accepted / max(1, drafts),
           "tokens_per_weight_read": tokens / max(1, sum(r.steps for r in runs)),
           "draft_passes": draft_passes, "drafting_s": drafting_s,
           "draft_share_of_decode": drafting_s / decode_s if decode_s else 0.0,
           "draft_pass_vs_plain_step": (drafting_s / draft_passes) / (plain_decode_s / plain_steps)
           if draft_passes and plain_steps else 0.0,
           "speedup": plain_decode_s / decode_s, "speedup_cpu": sum(r.cpu_s for r in plain) / cpu_s,
           "paired_median": paired(runs, plain, "decode_s"),
           "paired_median_cpu": paired(runs, plain, "cpu_s"),
           "greedy_differs_on": [i for i, (a, b) in enumerate(zip(runs, plain)) if a.tokens != b.tokens]}
    return res


def bench_draft_model(max_tokens: int, rounds: int, k: int = 3, adaptive: bool = True,
                      quantizations: tuple[str, ...] = ("auto",)) -> dict:
    from benchmarks.speculative import verify_cost

    engines = {"plain": LLM(max_num_seqs=1, cpu_kernels=True)}
    for quant in quantizations:
        engines[f"draft {quant}"] = LLM(max_num_seqs=1, cpu_kernels=True, speculative_config={
            "method": "draft_model", "model": "forwardpass-default-draft", "num_speculative_tokens": k,
            "adaptive": adaptive, "quantization": None if quant == "none" else quant})
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    prompts = heldout_prompts()
    names = list(engines)
    runs: dict[str, list[Run]] = {name: [] for name in names}
    for r in range(rounds):
        for i, prompt in enumerate(prompts):
            shift = (i + r) % len(names)  # rotate who goes first
            for name in names[shift:] + names[:shift]:
                runs[name].append(decode_run(engines[name], prompt, params))
    base = runs["plain"]
    plain_tokens = sum(len(x.tokens) - 1 for x in base)
    plain_decode = sum(x.decode_s for x in base)
    print(f"forwardpass-default, {len(prompts)} held-out prompts x {rounds}, k={k}, "
          f"{'adaptive' if adaptive else 'always'}: plain {plain_tokens / plain_decode:.1f} tok/s, "
          f"{1e3 * plain_decode / sum(x.steps for x in base):.2f} ms per decode step", flush=True)
    results: dict = {"k": k, "adaptive": adaptive, "prompts": len(prompts), "rounds": rounds,
                     "plain": {"tokens": plain_tokens, "decode_s": plain_decode,
                               "cpu_s": sum(x.cpu_s for x in base), "steps": sum(x.steps for x in base)},
                     "drafts": {}}
    for name in names[1:]:
        s = summary(name, runs[name], base, k)
        results["drafts"][name] = s
        (med, lo, hi), (cmed, clo, chi) = s["paired_median"], s["paired_median_cpu"]
        print(f"  {name:>12}: {s['tok_s']:.1f} tok/s = {s['speedup']:.2f}x (paired median {med:.2f}x, "
              f"{lo:.2f}-{hi:.2f}); CPU time {s['speedup_cpu']:.2f}x (paired median {cmed:.2f}x, "
              f"{clo:.2f}-{chi:.2f}); drafts {s['drafts']}, accepted {s['accepted']} "
              f"({s['acceptance_rate']:.0%}); tokens per target weight read "
              f"{s['tokens_per_weight_read']:.2f}; "
              f"the draft {s['draft_share_of_decode']:.0%} of the decode time, a draft pass "
              f"{s['draft_pass_vs_plain_step']:.2f} of a plain step; greedy tokens differ on prompts "
              f"{s['greedy_differs_on'] or 'none'}", flush=True)
    cost = verify_cost(engines[names[-1]], k)
    results["verify_cost"] = cost
    print("  target verify cost, forward of 1 + k decode rows / 1 row: "
          + ", ".join(f"k={n}: {c:.2f}" for n, c in cost.items()), flush=True)
    return results
