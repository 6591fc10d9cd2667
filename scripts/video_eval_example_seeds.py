#!/usr/bin/env python
"""How often one docs example shows what it says: a prompt run over seeds 0..N-1, each clip judged by the
independent judge (``forwardpass.diffusion.video.judge``) as ``tests/test_readme_examples.py`` judges the
docs' clip: the prompted digit in >= 6 of 8 frames, and the ink moving the prompted way.

    python scripts/video_eval_example_seeds.py "a handwritten 3 moving left"
    python scripts/video_eval_example_seeds.py "number seven drifting up" --framewise
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from forwardpass.diffusion.quality import DIGIT_WORDS
from forwardpass.diffusion.video import DEFAULT_VIDEO_MODEL_DIR
from forwardpass.diffusion.video.judge import load_judge
from forwardpass.diffusion.video.moving_digits import DIRECTIONS, direction_index
from forwardpass.diffusion.video.pipeline import VideoPipeline
from forwardpass.diffusion.video.quality import direction_agrees


def prompted_digit(prompt: str) -> int:
    words = prompt.lower().split()
    return next(int(w) if w.isdigit() else DIGIT_WORDS.index(w)
                for w in words if w.isdigit() or w in DIGIT_WORDS)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompt")
    ap.add_argument("--seeds", type=int, default=32)
    ap.add_argument("--framewise", action="store_true")
    ap.add_argument("--model", default=str(DEFAULT_VIDEO_MODEL_DIR))
    args = ap.parse_args()
    torch.set_num_threads(1)
    judge = load_judge(Path(DEFAULT_VIDEO_MODEL_DIR) / "judge_mnist_optdigits.npz")
    pipe = VideoPipeline.from_pretrained(args.model)
    digit, direction = prompted_digit(args.prompt), list(DIRECTIONS)[direction_index(args.prompt) - 1]
    clips = np.stack([pipe(args.prompt, seed=s, output_type="np", framewise=args.framewise,
                           show_progress=False).frames[0, ..., 0] for s in range(args.seeds)])  # fmt: skip
    kept = (judge.predict(clips) == digit).mean(1) >= 0.75
    moved = direction_agrees(clips, [direction] * len(clips))
    both = [s for s in range(args.seeds) if kept[s] and moved[s]]
    sampler = " (framewise)" if args.framewise else ""
    n = args.seeds
    print(f"{args.prompt!r}{sampler}, seeds 0-{n - 1}: digit in >= 6/8 frames {kept.sum()}/{n}, "
          f"moves {direction} {moved.sum()}/{n}, both {len(both)}: seeds {both}")


if __name__ == "__main__":
    main()
