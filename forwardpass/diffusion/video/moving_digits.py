"""Moving handwritten digits: the clips and captions the default video model is trained on.

A 28×28 MNIST digit (its ink lies in the central ~20×20) moves over a 32×32 black canvas: a velocity of
1–2 px per frame along the captioned direction plus a slow drift across it, reflecting off the canvas edges
(bounce) so the ink never leaves the frame. Positions are rounded to whole pixels when drawn.

Captions name the digit and the direction it starts moving in: "a handwritten 3 moving left",
"number seven drifting up". The same module renders the real clips the evaluation compares against.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from forwardpass.diffusion.quality import DIGIT_WORDS

CANVAS = 32
DIGIT = 28
# Top-left corner range that keeps the digit's ink (rows/cols 4..24 of the 28×28) inside the canvas.
POS_MIN, POS_MAX = -4, 8
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}  # (dx, dy) in image axes
OPPOSITE = {"left": "right", "right": "left", "up": "down", "down": "up"}
VERBS = ["moving", "drifting", "sliding", "going"]
MOTION_TEMPLATES = [
    "a handwritten {w} {v} {d}", "a handwritten {n} {v} {d}", "the digit {n} {v} {d}",
    "the digit {w} {v} {d}", "number {w} {v} {d}", "number {n} {v} {d}", "a {n} {v} {d}", "{w} {v} {d}",
    "digit {n} {v} {d}", "the number {w} {v} {d}",
]  # fmt: skip
STILL_TEMPLATES = ["a handwritten {w}", "a handwritten {n}", "the digit {n}", "number {w}", "{w}"]
# Words the video captions add to the image model's vocabulary.
NEW_WORDS = [*VERBS, *DIRECTIONS]


def direction_index(prompt: str) -> int:
    """The motion direction a prompt names: 0 for none, else 1 + its position in ``DIRECTIONS``. Training
    and the pipeline both read prompts with this, so the DiT's direction embedding means the same in both;
    the last direction word wins ("moving left then right" → right)."""
    names = list(DIRECTIONS)
    words = prompt.lower().replace(",", " ").replace(".", " ").split()
    found = [names.index(w) + 1 for w in words if w in names]
    return found[-1] if found else 0


def motion_caption(digit: int, direction: str, template: int, verb: int) -> str:
    return MOTION_TEMPLATES[template].format(w=DIGIT_WORDS[digit], n=digit, v=VERBS[verb], d=direction)


def all_captions() -> list[str]:
    """Every caption training can draw (the frozen text encoder embeds each once), the empty one first."""
    caps = [""]
    for digit in range(10):
        for t in range(len(MOTION_TEMPLATES)):
            for v in range(len(VERBS)):
                caps += [motion_caption(digit, d, t, v) for d in DIRECTIONS]
        caps += [t.format(w=DIGIT_WORDS[digit], n=digit) for t in STILL_TEMPLATES]
    return caps


def _bounce(p: float, lo: float, hi: float) -> float:
    """Fold a free position back into [lo, hi] as a ball reflecting off both walls would be."""
    span = hi - lo
    q = (p - lo) % (2 * span)
    return lo + (q if q <= span else 2 * span - q)


def trajectory(direction: str, num_frames: int, rng: random.Random) -> list[tuple[int, int]]:
    """Top-left positions ``(x, y)`` per frame: start on the side the digit moves away from, speed 1–2 px per
    frame, a drift of at most 0.5 px per frame across, bouncing off the edges."""
    dx, dy = DIRECTIONS[direction]
    speed, drift = rng.uniform(1.0, 2.0), rng.uniform(-0.5, 0.5)
    mid = (POS_MIN + POS_MAX) / 2
    along = mid - (speed * (num_frames - 1)) / 2 + rng.uniform(-2.0, 2.0)  # centred travel, jittered
    across = rng.uniform(POS_MIN, POS_MAX)
    out = []
    for f in range(num_frames):
        a = _bounce(along + speed * f, POS_MIN, POS_MAX)
        c = _bounce(across + drift * f, POS_MIN, POS_MAX)
        if dx:  # moving left is the mirror image of moving right along x
            x, y = (a if dx > 0 else POS_MAX + POS_MIN - a), c
        else:
            x, y = c, (a if dy > 0 else POS_MAX + POS_MIN - a)
        out.append((round(x), round(y)))
    return out


def render(digit_image: torch.Tensor, positions: list[tuple[int, int]]) -> torch.Tensor:
    """``digit_image [1, 28, 28]`` in [0, 1] → clip ``[F, 1, 32, 32]`` with the digit's
    top-left at each position."""
    margin = CANVAS - DIGIT + POS_MAX  # enough padding for every allowed position
    big = F.pad(digit_image, (margin,) * 4)
    frames = []
    for x, y in positions:
        top, left = margin - y, margin - x
        frames.append(big[:, top : top + CANVAS, left : left + CANVAS])
    return torch.stack(frames)


def random_clip(digit_image: torch.Tensor, num_frames: int, rng: random.Random) -> tuple[torch.Tensor, str]:
    """One training clip and the direction it was made with."""
    direction = rng.choice(list(DIRECTIONS))
    return render(digit_image, trajectory(direction, num_frames, rng)), direction
