"""Decode speed of the default thread count against ``--threads 1`` on a loaded machine, under both OpenMP
wait policies, and whether the oversubscription warning fires.

    python benchmarks/threads_under_load.py [--repeats 2] [--rounds 4] [--tokens 32] [--per-core 1]
        [--policies active,passive,default,spin:3000]

Starts ``--per-core`` busy-loop processes per usable core (0: none, the machine as it is), waits until the
1-minute load average exceeds the cores, then runs children alternately with ``OMP_WAIT_POLICY=active``
(spinning workers without bound: the policy before forwardpass set its own), ``passive`` (sleeping at once),
``default`` (forwardpass's own: passive with a bounded spin, ``forwardpass.OPENMP_WAIT``) and ``spin:N``
(forwardpass's passive policy with ``GOMP_SPINCOUNT=N``, to choose the bound). Each child loads the embedded
model once and alternates the default thread count and one thread over ``--rounds`` greedy requests
(paired: the same prompt, back to back), recording decode tokens/s (pure-decode steps only), the
oversubscription judge's measured / predicted ratio, and the warnings it logged. Prints medians and ranges;
``--json`` writes them. The judge needs this machine's roofline and overhead cached (measured here first if
missing, before the load).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The child: LLM() at the default thread count, then rounds alternating the default and one thread.
CHILD = r"""
import json, logging, sys
from forwardpass import LLM, SamplingParams
from forwardpass.analysis.oversubscription import watch_engine
from forwardpass.threads import apply_threads

class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())

records = []
logging.getLogger("forwardpass").addHandler(Keep())
rounds, tokens, modes = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
llm = LLM(num_kv_blocks=32)
default = llm.num_threads
watch = watch_engine(llm.engine)
params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
rates = {"default": [], "one": []}
ratios = {"default": [], "one": []}
judgements = []
for r in range(rounds):
    order = [("default", default), ("one", 1)][:: 1 if r % 2 == 0 else -1]
    for name, n in [(m, k) for m, k in order if m in modes]:
        apply_threads(n)
        llm.engine.core.stats.clear()
        llm.generate(["It was a truth universally acknowledged"], params, use_tqdm=False)
        steps = [s.duration_s for s in llm.engine.stats if s.num_decode_tokens and not s.num_prefill_tokens]
        rates[name].append(len(steps) / sum(steps))
        judged = watch.judge(llm.engine.stats)
        ratios[name].append(None if judged is None else judged["ratio"])
        judgements.append(judged)
print(json.dumps({"default_threads": default, "rates": rates, "ratios": ratios, "judgements": judgements,
                  "warnings": records}))
"""


def load_average() -> float:
    return os.getloadavg()[0]


@contextlib.contextmanager
def busy_machine(per_core: int = 1, wait_s: float = 120.0) -> Iterator[int]:
    """``per_core`` busy-loop processes per usable core, until the 1-minute load average exceeds the cores;
    yields the cores (raises TimeoutError if the load does not rise in ``wait_s``); ``per_core=0``: no load
    (the machine as it is)."""
    from forwardpass.threads import usable_cores

    cores = usable_cores()
    if per_core == 0:
        yield cores
        return
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(per_core * cores)]
    try:
        deadline = time.monotonic() + wait_s
        while load_average() <= cores + 0.5 and time.monotonic() < deadline:
            time.sleep(2)
        if load_average() <= cores:
            raise TimeoutError(f"load average {load_average():.1f} did not rise above {cores} cores in "
                               f"{wait_s:.0f} s")
        yield cores
    finally:
        for p in loops:
            p.kill()
        for p in loops:
            p.wait()


def run_child(policy: str, rounds: int, tokens: int, modes: str = "default,one",
              env_extra: dict[str, str] | None = None) -> dict:
    """One child process with ``OMP_WAIT_POLICY=policy`` (``"default"``: none, so forwardpass sets its own;
    ``"spin:N"``: forwardpass's own with ``GOMP_SPINCOUNT=N``; the thread count chosen by forwardpass);
    ``env_extra`` adds to its environment (a test's hardware cache).
    The OpenMP settings this process inherited (``import forwardpass`` sets them) are not passed on."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for name in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        env.pop(name, None)
    if policy.startswith("spin:"):
        env["GOMP_SPINCOUNT"] = policy.removeprefix("spin:")
    elif policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    env.update(env_extra or {})
    out = subprocess.run([sys.executable, "-c", CHILD, str(rounds), str(tokens), modes], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def ensure_prediction_cached() -> None:
    """The judge compares with this machine's measured roofline and overhead: measure them (once, cached)
    before any load starts, so the load does not skew them."""
    from forwardpass.analysis.hardware import this_machine
    from forwardpass.analysis.overhead import this_machine_overhead
    from forwardpass.analysis.oversubscription import cached_prediction_inputs

    if cached_prediction_inputs() is None:
        this_machine()
        this_machine_overhead()


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def summarize(children: dict[str, list[dict]]) -> dict:
    out = {}
    for policy, runs in children.items():
        one = [x for r in runs for x in r["rates"]["one"]]
        default = [x for r in runs for x in r["rates"]["default"]]
        paired = [o / d for r in runs for o, d in zip(r["rates"]["one"], r["rates"]["default"], strict=True)]
        out[policy] = {
            "default_threads": runs[0]["default_threads"], "one_tok_s": one, "default_tok_s": default,
            "paired_ratio_one_over_default": paired, "median_ratio": median(paired),
            "judge_ratio_default": [x for r in runs for x in r["ratios"]["default"]],
            "warned": sum(any("decode steps take" in w for w in r["warnings"]) for r in runs),
            "children": len(runs)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2, help="children per policy (policies alternate)")
    ap.add_argument("--rounds", type=int, default=4, help="paired default / one-thread requests per child")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--per-core", type=int, default=1, help="busy-loop processes per usable core (0: none)")
    ap.add_argument("--policies", default="active,passive,default",
                    help="comma-separated: active, passive, default (forwardpass's own), spin:N")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    ensure_prediction_cached()
    children: dict[str, list[dict]] = {policy: [] for policy in args.policies.split(",")}
    with busy_machine(args.per_core) as cores:
        start_load = load_average()
        for _ in range(args.repeats):
            for policy in children:
                children[policy].append(run_child(policy, args.rounds, args.tokens))
        end_load = load_average()
    summary = {"cores": cores, "load_average": [start_load, end_load], "per_core": args.per_core,
               **summarize(children)}
    for policy in children:
        s = summary[policy]
        paired = s["paired_ratio_one_over_default"]
        print(f"{policy:11s} --threads 1 {min(s['one_tok_s']):.1f}-{max(s['one_tok_s']):.1f} tok/s, default "
              f"({s['default_threads']}) {min(s['default_tok_s']):.1f}-{max(s['default_tok_s']):.1f} tok/s; "
              f"paired one/default median {s['median_ratio']:.2f}x "
              f"({min(paired):.2f}-{max(paired):.2f}); "
              f"judge measured/predicted at the default "
              f"{[round(x, 1) for x in s['judge_ratio_default'] if x is not None]}; "
              f"warned in {s['warned']}/{s['children']} children")
    print(f"load average {start_load:.1f} -> {end_load:.1f} on {cores} cores ({args.per_core} busy loop(s) "
          "per core, plus whatever else ran)")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
