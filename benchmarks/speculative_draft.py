"""The embedded model with its shipped draft (``forwardpass-default-draft``) against plain decoding.

    python -m benchmarks.speculative --method draft_model -k 4 --threads 1 [--max-tokens 64] [--rounds 1]

On the embedded model's own held-out text. Batch 1, greedy, same run, alternating: each prompt (a passage of
the held-out Austen text, never seen in training by either model, at ``HELDOUT_OFFSETS``) runs once without
and once with the draft on the same engine pair, which one goes first alternating. The decode time counts
every step after the prefill, the draft's own forward passes included (they run in ``schedule()``, inside
the step). Printed: tokens/s both ways, the ratio of the totals and the per-prompt paired median, the draft
acceptance rate, and tokens per weight read of the target (generated tokens / target forward passes).
"""

from __future__ import annotations

import statistics

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


Result = tuple[list[int], float, int, int, int]


def decode_run(llm: LLM, prompt: str, params: SamplingParams) -> Result:
    """(tokens, decode seconds, decode steps, drafts, accepted) of one request; decode time is the steps
    after the prefill's, each step's own duration (schedule with the draft's passes, forward, update)."""
    llm.engine.stats.clear()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    steps = [r for r in llm.engine.stats if not r.num_prefill_tokens]
    return (list(out.outputs[0].token_ids), sum(r.duration_s for r in steps), len(steps),
            out.metrics.num_draft_tokens, out.metrics.num_accepted_tokens)


def bench_draft_model(max_tokens: int, rounds: int, k: int = 4, adaptive: bool = True) -> dict:
    base = LLM(max_num_seqs=1, cpu_kernels=True)
    spec = LLM(max_num_seqs=1, cpu_kernels=True, speculative_config={
        "method": "draft_model", "model": "forwardpass-default-draft", "num_speculative_tokens": k,
        "adaptive": adaptive})
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    prompts = heldout_prompts()
    acc = {"base_s": 0.0, "spec_s": 0.0, "tokens": 0, "base_steps": 0, "spec_steps": 0, "drafts": 0,
           "accepted": 0}
    paired, differ = [], []
    for r in range(rounds):
        for i, prompt in enumerate(prompts):
            order = [(base, "base"), (spec, "spec")]
            if (i + r) % 2:
                order.reverse()
            runs = {tag: decode_run(llm, prompt, params) for llm, tag in order}
            (tb, sb, nb, _, _), (ts, ss, ns, d, a) = runs["base"], runs["spec"]
            if tb != ts:
                differ.append(i)
            if sb > 0 and ss > 0:
                paired.append(sb / ss)
            acc["base_s"] += sb
            acc["spec_s"] += ss
            acc["tokens"] += len(tb) - 1  # the first token comes from the prefill step
            acc["base_steps"] += nb
            acc["spec_steps"] += ns
            acc["drafts"] += d
            acc["accepted"] += a
    res = {**acc, "k": k, "adaptive": adaptive, "prompts": len(prompts), "rounds": rounds,
           "base_tok_s": acc["tokens"] / acc["base_s"], "spec_tok_s": acc["tokens"] / acc["spec_s"],
           "acceptance_rate": acc["accepted"] / max(1, acc["drafts"]),
           "tokens_per_weight_read_spec": acc["tokens"] / max(1, acc["spec_steps"]),
           "paired_median": statistics.median(paired), "paired_range": (min(paired), max(paired)),
           "greedy_differs_on": differ}
    res["speedup"] = res["spec_tok_s"] / res["base_tok_s"]
    print(f"forwardpass-default + draft (k={k}, adaptive={adaptive}), {len(prompts)} held-out prompts x "
          f"{rounds}: "
          f"{res['base_tok_s']:.1f} tok/s plain, {res['spec_tok_s']:.1f} tok/s with the draft "
          f"({res['speedup']:.2f}x; per-prompt paired median {res['paired_median']:.2f}x, range "
          f"{res['paired_range'][0]:.2f}-{res['paired_range'][1]:.2f}); drafts {acc['drafts']}, accepted "
          f"{acc['accepted']} ({res['acceptance_rate']:.0%}); tokens per weight read 1.00 -> "
          f"{res['tokens_per_weight_read_spec']:.2f}; greedy tokens differ on prompts {differ or 'none'}",
          flush=True)
    return res
