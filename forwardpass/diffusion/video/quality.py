"""Measuring drift: does a generated clip keep the prompted digit, keep *one* digit, and move smoothly?

The judge is the image model's ``eval_classifier`` (a CNN trained only on real, held-out MNIST digits, centred
with ±2 px shifts), so each frame is first re-centred on its centre of mass, as MNIST itself was made; its
accuracy on re-centred *real* moving clips is the reference row of the table.

Per clip (frames ``[F, H, W]`` in [0, 1]):

* ``frame_rate``: frames classified as the prompted digit;
* ``kept``: clips in which *every* frame is the prompted digit (what drift breaks);
* ``consistency``: frames that agree with the clip's most common prediction (one identity, right or wrong);
* ``jerk``: mean |Δ velocity| of the ink's centre of mass, px/frame² (smooth motion is near 0; a bounce is
  one spike, a digit that jumps or flickers many);
* ``direction``: clips whose centre of mass ends ≥ 1 px further along the prompted direction than it began;
* ``frame_rate_by_position``: ``frame_rate`` of the 1st, 2nd, ... frame of the clips.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from forwardpass.diffusion.quality import DIGIT_WORDS, DigitClassifier
from forwardpass.diffusion.video.moving_digits import DIRECTIONS

EVAL_TEMPLATES = ["a handwritten {n} moving {d}", "the digit {w} drifting {d}", "number {w} moving {d}",
                  "a {n} sliding {d}"]  # fmt: skip


def eval_prompts(n: int) -> tuple[list[str], list[int], list[str]]:
    """``n`` prompts cycling through the ten digits, then the four directions, then the wordings."""
    names = list(DIRECTIONS)
    prompts, digits, dirs = [], [], []
    for i in range(n):
        digit, direction = i % 10, names[(i // 10 + i) % 4]
        template = EVAL_TEMPLATES[(i // 40) % len(EVAL_TEMPLATES)]
        prompts.append(template.format(n=digit, w=DIGIT_WORDS[digit], d=direction))
        digits.append(digit)
        dirs.append(direction)
    return prompts, digits, dirs


def centres(frames: np.ndarray) -> np.ndarray:
    """Ink centre of mass ``[..., 2]`` as (x, y) for frames ``[..., H, W]``; the canvas
    centre for blank frames."""
    h, w = frames.shape[-2:]
    mass = frames.sum((-2, -1))
    ys, xs = np.arange(h, dtype=np.float64), np.arange(w, dtype=np.float64)
    safe = np.where(mass > 1e-6, mass, 1.0)
    cx = np.where(mass > 1e-6, (frames.sum(-2) * xs).sum(-1) / safe, (w - 1) / 2)
    cy = np.where(mass > 1e-6, (frames.sum(-1) * ys).sum(-1) / safe, (h - 1) / 2)
    return np.stack([cx, cy], -1)


def direction_agrees(frames: np.ndarray, dirs: list[str], min_px: float = 1.0) -> np.ndarray:
    """Per clip ``frames [N, F, H, W]``: did the ink's centre of mass move (first frame to last) further
    along the prompted direction than along any other of the four, and by at least ``min_px``?"""
    com = centres(frames)
    travel = com[:, -1] - com[:, 0]  # (dx, dy)
    names = list(DIRECTIONS)
    along = travel @ np.array([DIRECTIONS[d] for d in names], dtype=np.float64).T  # [N, 4]
    want = np.array([names.index(d) for d in dirs])
    return (along.argmax(1) == want) & (along[np.arange(len(dirs)), want] >= min_px)


def recentre(frames: np.ndarray) -> np.ndarray:
    """Shift each frame ``[N, H, W]`` by whole pixels so its ink's centre of mass is the canvas centre."""
    n, h, w = frames.shape
    com = centres(frames)
    out = np.zeros_like(frames)
    padded = np.pad(frames, ((0, 0), (h, h), (w, w)))
    for i in range(n):
        dx = round((w - 1) / 2 - com[i, 0])
        dy = round((h - 1) / 2 - com[i, 1])
        out[i] = padded[i, h - dy : 2 * h - dy, w - dx : 2 * w - dx]
    return out


@torch.no_grad()
def classify_frames(classifier: DigitClassifier, frames: np.ndarray) -> np.ndarray:
    """Frames ``[N, F, H, W]`` in [0, 1] → predicted digit per frame ``[N, F]``."""
    n, f, h, w = frames.shape
    x = torch.from_numpy(recentre(frames.reshape(n * f, h, w)).astype(np.float32))[:, None]
    return classifier.eval()(x).argmax(-1).numpy().reshape(n, f)


def clip_metrics(classifier: DigitClassifier, frames: np.ndarray, digits: list[int], dirs: list[str]) -> dict:
    """The module docstring's metrics, averaged over clips ``frames [N, F, H, W]``."""
    pred = classify_frames(classifier, frames)
    want = np.asarray(digits)[:, None]
    correct = pred == want
    mode = np.array([np.bincount(p, minlength=10).argmax() for p in pred])
    com = centres(frames)  # [N, F, 2]
    vel = np.diff(com, axis=1)
    jerk = np.abs(np.diff(vel, axis=1)).sum(-1).mean() if frames.shape[1] > 2 else 0.0
    unit = np.array([DIRECTIONS[d] for d in dirs], dtype=np.float64)  # (dx, dy)
    travel = ((com[:, -1] - com[:, 0]) * unit).sum(-1)
    return {
        "clips": len(digits),
        "frame_rate": float(correct.mean()),
        "kept": float(correct.all(1).mean()),
        "consistency": float((pred == mode[:, None]).mean()),
        "jerk": float(jerk),
        "direction": float((travel >= 1.0).mean()),
        # drift shows as a rate that falls with the frame's position in the clip
        "frame_rate_by_position": [round(float(r), 4) for r in correct.mean(0)],
    }


def generate_clips(pipe: Any, n: int, *, framewise: bool = False, seed: int = 0, batch_size: int = 10,
                   **call_kwargs: Any) -> np.ndarray:  # fmt: skip
    """The ``n`` evaluation prompts' clips (``eval_prompts``), whole-clip or frame by frame: one generator
    seeded with ``seed`` drawn through batches of ``batch_size`` prompts; [n, frames, H, W] in [0, 1]."""
    prompts = eval_prompts(n)[0]
    generator = torch.Generator().manual_seed(seed)
    clips = []
    for start in range(0, n, batch_size):
        out = pipe(prompts[start : start + batch_size], generator=generator, output_type="np",
                   framewise=framewise,
                   show_progress=False, **call_kwargs)  # fmt: skip
        clips.append(out.frames[..., 0])
    return np.concatenate(clips)


def evaluate(pipe: Any, classifier: DigitClassifier, n: int = 40, *, framewise: bool = False, seed: int = 0,
             batch_size: int = 10, **call_kwargs: Any) -> dict:  # fmt: skip
    """Generate ``n`` clips (``eval_prompts``) whole-clip or frame by frame and measure them."""
    _, digits, dirs = eval_prompts(n)
    clips = generate_clips(pipe, n, framewise=framewise, seed=seed, batch_size=batch_size, **call_kwargs)
    return clip_metrics(classifier, clips, digits, dirs)
