"""How far the ngram policy is from what its drafts allow: an offline replay on the real greedy outputs.

    python benchmarks/speculative_replay.py [--threads 1] [-k 8] [--model smollm2]

Greedy decoding is deterministic and speculation is lossless, so the tokens a request emits are known once it
has run plainly; then any drafting policy can be replayed without the model: at each step the ngram proposer
offers drafts from the tokens so far, the target accepts their common prefix with the true continuation, and
the step costs ``T(1 + k) / T(1)`` of a one-row step, measured here on this host (``speculative.py``'s
``verify_cost``: forwards with logits over the rows of a real verify step, alternating sizes). Replayed on the
benchmark's copy-heavy and novel prompts (``speculative.py``) and on held-out copy-heavy prompts
(``speculative_heldout.py``: a policy change should gain there too, not only on the prompts it was built on):

* ``policy``: the engine's ``Speculator`` as it runs (adaptive, the same cost table);
* ``always k``: every offered draft verified (no policy);
* ``oracle``: at each step the number of drafts that maximises tokens per cost *knowing* how many will be
  accepted: no policy can do better with these drafts and these costs;
* ``perfect drafts``: the true continuation proposed at every step (the oracle's sizing): what any drafter
  could reach with these costs.

Printed: speedup over plain decoding (tokens · T(1) / Σ step costs) and tokens per forward pass. It models
step cost by rows only (the engine's own figure is in speculative.py); it measures the policy against bounds,
not speed. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import torch

from benchmarks.speculative import COPY_PROMPTS, NOVEL_PROMPTS, verify_cost
from benchmarks.speculative_heldout import HELDOUT_COPY_PROMPTS
from forwardpass import LLM, SamplingParams
from forwardpass.config import SpeculativeConfig
from forwardpass.engine.scheduling.speculation import DraftStats
from forwardpass.engine.speculative.ngram import NgramProposer
from forwardpass.engine.speculative.policy import Speculator


@dataclass
class Replayed:
    """What the policy reads of a sequence (as the scheduler's ``Sequence``)."""

    token_ids: list[int]
    output_token_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams
    draft_stats: DraftStats = field(default_factory=DraftStats)


def accepted(drafts: tuple[int, ...], truth: list[int]) -> int:
    n = 0
    while n < len(drafts) and n < len(truth) and drafts[n] == truth[n]:
        n += 1
    return n


def best_k(acc: int, cost: dict[int, float]) -> int:
    """Drafts to verify when ``acc`` of them will be accepted: the most tokens per cost."""
    return max(range(acc + 1), key=lambda k: (k + 1) / cost[k])


def replay(runs: list[tuple[list[int], list[int]]], cost: dict[int, float], mode: str, k: int,
           speculator: Speculator) -> tuple[float, float]:
    """``(speedup over plain, tokens per pass)`` of ``mode`` over ``runs`` (prompt ids, greedy output); every
    mode drafts with ``speculator``'s proposer, only ``policy`` sizes the drafts with it."""
    proposer = speculator.proposer
    assert isinstance(proposer, NgramProposer), "the replay drafts by prompt lookup"
    total_cost = tokens = passes = 0.0
    for prompt, out in runs:
        params = SamplingParams(temperature=0, max_tokens=len(out))
        seq = Replayed(prompt + out[:1], out[:1], len(prompt), params)
        pos = 1
        while pos < len(out):
            room = min(k, len(out) - pos - 1)  # as the scheduler: no drafts past max_tokens
            truth = out[pos:]
            if mode == "policy":
                drafts = speculator.drafts_for_step(seq, 1, 1 << 20, 1, 1 << 30)
                n = accepted(drafts, truth)
                if drafts:
                    speculator.record(seq.draft_stats, len(drafts), n)
                used = len(drafts)
            elif mode == "perfect drafts":
                n = used = best_k(room, cost)
            else:
                drafts = proposer.match(seq.token_ids, room)[0] if room > 0 else ()
                n = accepted(drafts, truth)
                used = len(drafts) if mode == "always" else best_k(n, cost)
                n = min(n, used)
            total_cost += cost[used]
            passes += 1
            emitted = out[pos : pos + n + 1]
            seq.token_ids += emitted
            seq.output_token_ids += emitted
            seq.num_computed_tokens = len(seq.token_ids) - 1
            pos += len(emitted)
        tokens += len(out) - 1
    return tokens / total_cost, tokens / passes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="smollm2, or default (embedded)")
    ap.add_argument("-k", type=int, default=8, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1,
            "prompt_lookup_max": 4}
    config = SpeculativeConfig(**spec)
    kwargs = {"max_num_seqs": 1, "cpu_kernels": True, "num_threads": args.threads, "speculative_config": spec}
    # its greedy tokens are plain decoding's (lossless, tests/test_speculative_fast_path.py)
    llm = LLM(**kwargs) if args.model == "default" else LLM(args.model, **kwargs)
    ratios = verify_cost(llm, args.k)
    cost = {0: 1.0, **ratios}
    print(f"{args.model}: verify cost T(1 + k) / T(1), this host: "
          + ", ".join(f"k={k}: {c:.2f}" for k, c in ratios.items()))
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    sets = (("copy", COPY_PROMPTS), ("held-out copy", HELDOUT_COPY_PROMPTS), ("novel", NOVEL_PROMPTS))
    for kind, prompts in sets:
        runs = []
        for prompt in prompts:
            ids = tok.encode(prompt)
            out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
            runs.append((ids, list(out.token_ids)))
        speculator = Speculator(config)
        speculator.costs.mean = {1 + k: c for k, c in cost.items()}  # fixed: the replay observes no step
        for mode in ("policy", "always", "oracle", "perfect drafts"):
            speedup, per_pass = replay(runs, cost, mode, args.k, speculator)
            print(f"  {kind:>13} {mode:>14}: {speedup:.2f}x plain decoding, {per_pass:.2f} tokens per pass")


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"total {time.perf_counter() - t0:.0f} s")
