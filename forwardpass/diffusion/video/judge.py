"""An independent digit judge for generated frames: crop the ink, shrink to sklearn's 8×8 digits, classify.

Why a second judge: the image model's ``eval_classifier`` is a CNN trained by this project next to the
generator, on MNIST digits re-centred by their centre of mass. A judge that shares nothing with the
generator's training is harder to flatter: this one is fit on *real* handwriting only — scikit-learn's
bundled digits (UCI optdigits, 1,797 8×8 images from 43 writers, another dataset than MNIST) plus real MNIST
digits the generator never saw — and it reads every frame the way optdigits was made: the ink's bounding box
scaled into a square 32×32 bitmap, thresholded, and counted in 4×4 blocks (0–16 per cell). Cropping makes it
blind to where the digit is, so a digit that moves is judged like one that does not.

A blank or near-blank frame (no pixel above ``INK``) gets the label ``-1``: never the prompted digit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

INK = 0.35  # a pixel is ink above this (frames in [0, 1]); the VAE's background sits near 0
BITMAP = 32  # optdigits' bitmap size: 32×32 binary, then 4×4 block counts
BLANK = -1


def optdigits_features(frames: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Frames ``[N, H, W]`` in [0, 1] → ``(features [N, 64] in 0..16, has_ink [N])``.

    Each frame's ink bounding box is padded to a square around its centre, resized to 32×32, thresholded at
    half intensity and summed over 4×4 blocks — optdigits' own preprocessing of its scanned forms."""
    n = len(frames)
    feats = np.zeros((n, 64), dtype=np.float32)
    has_ink = np.zeros(n, dtype=bool)
    for i, frame in enumerate(frames):
        ys, xs = np.nonzero(frame > INK)
        if len(ys) < 3:
            continue
        has_ink[i] = True
        y0, y1, x0, x1 = ys.min(), ys.max() + 1, xs.min(), xs.max() + 1
        crop = frame[y0:y1, x0:x1]
        side = max(crop.shape)
        square = np.zeros((side, side), dtype=np.float32)
        top, left = (side - crop.shape[0]) // 2, (side - crop.shape[1]) // 2
        square[top : top + crop.shape[0], left : left + crop.shape[1]] = crop
        big = F.interpolate(torch.from_numpy(square)[None, None], size=(BITMAP, BITMAP), mode="bilinear",
                            align_corners=False)[0, 0].numpy()  # fmt: skip
        bits = (big > 0.5).astype(np.float32)
        feats[i] = bits.reshape(8, 4, 8, 4).sum((1, 3)).reshape(64)
    return feats, has_ink


@dataclass
class DigitJudge:
    """A fitted classifier over ``optdigits_features``; ``predict`` labels frames (``-1`` for blank ones)."""

    model: object
    sources: str

    def predict(self, frames: np.ndarray) -> np.ndarray:
        """Frames ``[..., H, W]`` in [0, 1] → digit per frame ``[...]``."""
        lead, (h, w) = frames.shape[:-2], frames.shape[-2:]
        feats, has_ink = optdigits_features(frames.reshape(-1, h, w))
        pred = np.full(len(feats), BLANK, dtype=np.int64)
        if has_ink.any():
            pred[has_ink] = self.model.predict(feats[has_ink])  # type: ignore[attr-defined]
        return pred.reshape(lead)


def fit_judge(mnist: tuple[np.ndarray, np.ndarray] | None = None) -> DigitJudge:
    """Fit on scikit-learn's optdigits (always) and, when given, real MNIST digits as optdigits features
    ``(features [N, 64] in 0..16, labels [N])`` — only digits the generator was not trained on. An RBF SVM,
    ~1 s to fit."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.svm import SVC
    except ImportError as exc:  # a test-extra dependency (through sentence-transformers), not a runtime one
        raise ImportError("the independent digit judge needs scikit-learn: pip install scikit-learn") from exc
    digits = load_digits()
    x, y = [digits.data.astype(np.float32)], [digits.target.astype(np.int64)]
    sources = f"sklearn optdigits ({len(digits.target)})"
    if mnist is not None:
        x.append(np.asarray(mnist[0], dtype=np.float32))
        y.append(np.asarray(mnist[1]).astype(np.int64))
        sources += f" + real MNIST ({len(mnist[1])})"
    model = SVC(C=10.0, gamma="scale").fit(np.concatenate(x), np.concatenate(y))
    return DigitJudge(model=model, sources=sources)


def load_judge(mnist_features: str | Path) -> DigitJudge:
    """The judge the video README's figures use: optdigits + the MNIST features saved by
    ``scripts/video_eval_claims.py --build-judge-data`` (an ``.npz`` of arrays, no pickles)."""
    with np.load(mnist_features, allow_pickle=False) as data:
        return fit_judge((data["features"], data["labels"]))
