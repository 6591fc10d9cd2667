"""Measured quality: a small CNN digit classifier, trained on real MNIST digits that the generator never
saw, judges whether generated images show the digit the prompt asked for.

``recognition_rate(pipe, classifier, ...)`` generates ``n`` images cycling through the ten digits with
varied captions and returns the fraction the classifier labels as the requested digit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from forwardpass.diffusion.modeling import ConfigModule

DIGIT_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
# Captions the evaluation asks for: a mix of wordings, none needing an adjective.
EVAL_TEMPLATES = ["a handwritten {w}", "the digit {n}", "number {w}", "a handwritten {n}", "{w}"]


class DigitClassifier(ConfigModule):
    WEIGHTS_NAME = "model.safetensors"
    DEFAULTS: ClassVar[dict[str, Any]] = {"image_size": 32, "channels": [32, 64, 64], "num_classes": 10}

    def __init__(self, **config):
        super().__init__(**config)
        c1, c2, c3 = self.config["channels"]
        self.features = nn.Sequential(
            nn.Conv2d(1, c1, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c2, c3, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
        )  # fmt: skip
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.3), nn.Linear(4 * c3, 128), nn.ReLU(),
                                  nn.Linear(128, self.config["num_classes"]))  # fmt: skip

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """``images [B, 1, 32, 32]`` in [0, 1] → logits ``[B, 10]``."""
        return self.head(self.features(images * 2 - 1))


def load_classifier(directory: str | Path) -> DigitClassifier:
    return DigitClassifier.from_pretrained(directory)


def eval_prompts(n: int) -> tuple[list[str], list[int]]:
    prompts, labels = [], []
    for i in range(n):
        digit = i % 10
        template = EVAL_TEMPLATES[(i // 10) % len(EVAL_TEMPLATES)]
        prompts.append(template.format(w=DIGIT_WORDS[digit], n=digit))
        labels.append(digit)
    return prompts, labels


@torch.no_grad()
def classify(classifier: DigitClassifier, images: np.ndarray) -> np.ndarray:
    """``images [B, H, W, 1]`` in [0, 1] (the pipeline's ``output_type="np"``) → predicted digits."""
    x = torch.from_numpy(np.ascontiguousarray(images)).float().permute(0, 3, 1, 2)
    if x.shape[-1] != classifier.config["image_size"]:
        x = F.interpolate(x, size=classifier.config["image_size"], mode="bilinear", align_corners=False)
    return classifier.eval()(x).argmax(-1).numpy()


@torch.no_grad()
def recognition_stats(
    pipe, classifier: DigitClassifier, n: int = 200, batch_size: int = 50, seed: int = 0, **call_kwargs
) -> dict[str, float]:
    """Generate ``n`` images (digits 0–9 in turn); return the fraction recognized as the requested digit
    (``rate``) and the classifier's mean probability for the requested digit (``confidence``, which still
    separates settings once the rate saturates at 100%)."""
    prompts, labels = eval_prompts(n)
    generator = torch.Generator().manual_seed(seed)
    correct, prob = 0, 0.0
    for start in range(0, n, batch_size):
        out = pipe(prompts[start : start + batch_size], generator=generator, output_type="np",
                   show_progress=False, **call_kwargs)  # fmt: skip
        x = torch.from_numpy(np.ascontiguousarray(out.images)).float().permute(0, 3, 1, 2)
        if x.shape[-1] != classifier.config["image_size"]:
            x = F.interpolate(x, size=classifier.config["image_size"], mode="bilinear", align_corners=False)
        p = classifier.eval()(x).softmax(-1)
        want = torch.tensor(labels[start : start + batch_size])
        correct += int((p.argmax(-1) == want).sum())
        prob += float(p[torch.arange(len(want)), want].sum())
    return {"rate": correct / n, "confidence": prob / n}


def recognition_rate(pipe, classifier: DigitClassifier, n: int = 200, batch_size: int = 50, seed: int = 0,
                     **call_kwargs) -> float:  # fmt: skip
    """Generate ``n`` images (digits 0–9 in turn) and return the fraction recognized
    as the requested digit."""
    return recognition_stats(pipe, classifier, n=n, batch_size=batch_size, seed=seed, **call_kwargs)["rate"]
