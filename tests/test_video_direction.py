"""The video DiT's direction input (issue 43): the prompt stays text, ``moving_digits.direction_index`` parses
its direction word the same way for training and for the pipeline, and a learned embedding of it enters the
DiT's per-frame adaLN conditioning."""

from __future__ import annotations

import pytest
import torch

from forwardpass.diffusion.video.dit import VideoDiTModel
from forwardpass.diffusion.video.moving_digits import DIRECTIONS, all_captions, direction_index


def test_direction_index_reads_the_word():
    assert [direction_index(p) for p in ("a handwritten 3 moving left", "Number seven drifting UP.",
                                         "two moving down", "a 5 sliding right", "a handwritten 3", "")] \
        == [1, 3, 4, 2, 0, 0]  # fmt: skip
    assert direction_index("moving left, then right") == 2  # the last word wins
    # every training caption with a direction word gets that direction
    for cap in all_captions():
        words = cap.split()
        named = [w for w in words if w in DIRECTIONS]
        assert direction_index(cap) == (list(DIRECTIONS).index(named[-1]) + 1 if named else 0)


def _tiny(**kw) -> VideoDiTModel:
    torch.manual_seed(0)
    model = VideoDiTModel(hidden_size=32, num_layers=1, num_attention_heads=2, cross_attention_dim=16,
                          num_frames=4, attention_mode="factorized", **kw).eval()  # fmt: skip
    for p in model.parameters():  # the zero-init output layers would hide every difference
        torch.nn.init.normal_(p, std=0.1)
    return model


def _inputs(b: int = 4):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(b, 4, 4, 8, 8, generator=g), torch.full((b,), 900.0),
            torch.randn(b, 5, 16, generator=g))  # fmt: skip


def test_with_directions_starts_as_the_model_without():
    plain = _tiny()
    x, t, ctx = _inputs()
    grown = plain.with_directions(len(DIRECTIONS))
    assert grown.config["num_directions"] == 4 and grown.direction_embed.weight.abs().sum() == 0
    with torch.no_grad():
        torch.testing.assert_close(grown(x, t, ctx, None, torch.tensor([0, 1, 2, 3])), plain(x, t, ctx))
        assert plain(x, t, ctx, None, torch.tensor([1, 1, 1, 1])).equal(plain(x, t, ctx))  # ignored without


def test_direction_changes_the_prediction_frame_by_frame():
    model = _tiny(num_directions=4)
    x, t, ctx = _inputs()
    with torch.no_grad():
        torch.nn.init.normal_(model.direction_embed.weight)
        same = model(x, t, ctx, None, torch.tensor([1, 1, 1, 1]))
        other = model(x, t, ctx, None, torch.tensor([2, 2, 2, 2]))
        cond = model._direction_conditioning(torch.tensor([1, 2]), 4)
    assert (same - other).abs().amax() > 1e-3
    # the motion half is signed by the frame's place in the clip: frames 0 and 3 mirror around the middle
    glob, motion = model.direction_embed.weight[1:3].chunk(2, dim=-1)
    torch.testing.assert_close(cond[:, 0] + cond[:, 3], 2 * glob)
    torch.testing.assert_close(cond[:, 3] - cond[:, 0], 0.75 * motion)


@pytest.mark.parametrize(("negative", "mode", "expected"), [
    (None, "replace", [0, 0, 1, 3]),
    ("moving down", "replace", [4, 4, 1, 3]),
    ("moving down", "perp", [0, 0, 4, 4, 1, 3]),
])  # fmt: skip
def test_pipeline_direction_rows_follow_the_text_batch(negative, mode, expected):
    """The direction of each text row, in the order ``_text_batch`` stacks the rows; a model call sees it."""
    from forwardpass.diffusion.video import DEFAULT_VIDEO_MODEL_DIR
    from forwardpass.diffusion.video.pipeline import VideoPipeline

    pipe = VideoPipeline.from_pretrained(DEFAULT_VIDEO_MODEL_DIR)
    if not pipe.transformer.config["num_directions"]:
        pipe.transformer = pipe.transformer.with_directions(4)
    prompts = ["a handwritten 3 moving left", "two moving up"]
    negs = None if negative is None else [negative] * 2
    rows = pipe._direction_batch(prompts, negs, 1, 3 if mode == "perp" else 2)
    assert rows.tolist() == expected
    seen = []
    inner = pipe.transformer.forward
    pipe.transformer.forward = lambda *a: seen.append(a[4].tolist()) or inner(*a)
    pipe(prompts, negative_prompt=negative, negative_mode=mode, num_inference_steps=1, show_progress=False)
    assert seen == [expected]
