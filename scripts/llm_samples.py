"""Print greedy and sampled generations (and chat answers) of the embedded default LLM, via the engine.

    python scripts/llm_samples.py            # the shipped model
    python scripts/llm_samples.py --model DIR

Sampled generations use the model's generation_config defaults (temperature 0.8, top-p 0.95) and a
fixed per-request seed, so the output is reproducible on the same machine.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # the repo's forwardpass, also when run as a file

import argparse

PROMPTS = ["Once upon a time", "It was a fine morning, and Elizabeth", "Mr. Darcy", "The weather was"]
QUESTIONS = ["Hello!", "Who wrote Pride and Prejudice?", "Who is Mr. Knightley?", "Tell me a story."]


def main() -> None:
    from forwardpass import LLM, SamplingParams
    from forwardpass.assets import default_llm_path

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=str(default_llm_path()))
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    llm = LLM(args.model)
    base = llm.engine.default_sampling_params()
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    print("## Greedy (temperature 0)\n")
    for p, o in zip(PROMPTS, llm.generate(PROMPTS, greedy, use_tqdm=False)):
        print(f"- **{p}**{o.outputs[0].text}")
    print(f"\n## Sampled (temperature {base.temperature}, top-p {base.top_p}, seed {args.seed})\n")
    sampled = [
        SamplingParams(
            temperature=base.temperature, top_p=base.top_p, max_tokens=args.max_tokens, seed=args.seed + i
        )
        for i in range(len(PROMPTS))
    ]
    for p, o in zip(PROMPTS, llm.generate(PROMPTS, sampled, use_tqdm=False)):
        print(f"- **{p}**{o.outputs[0].text}")
    print("\n## Chat (greedy)\n")
    for q in QUESTIONS:
        o = llm.chat(
            [{"role": "user", "content": q}], SamplingParams(temperature=0, max_tokens=80), use_tqdm=False
        )[0].outputs[0]
        print(f"- user: {q}\n  assistant: {o.text.strip()}  _({o.finish_reason})_")


if __name__ == "__main__":
    main()
