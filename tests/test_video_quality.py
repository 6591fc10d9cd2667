"""Drift measurement (metrics and the fast whole-clip vs frame-by-frame evaluation) and the video analyzer."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from forwardpass.analysis.video import batch_sweep, frames_sweep, video_dit_cost
from forwardpass.diffusion.video.quality import centres, clip_metrics, recentre
from forwardpass.op_cost import MATMUL


def _blob_clip(xs: list[float], y: float = 16.0) -> np.ndarray:
    """A 5×5 square whose centre moves along ``xs``."""
    clip = np.zeros((len(xs), 32, 32), dtype=np.float32)
    for f, x in enumerate(xs):
        x0, y0 = round(x - 2), round(y - 2)
        clip[f, y0 : y0 + 5, x0 : x0 + 5] = 1.0
    return clip


def test_centres_and_recentre():
    clip = _blob_clip([6.0, 20.0])
    np.testing.assert_allclose(centres(clip), [[6.0, 16.0], [20.0, 16.0]])
    np.testing.assert_allclose(centres(recentre(clip)), [[15.5, 15.5]] * 2, atol=0.51)


class FixedClassifier(torch.nn.Module):
    """A stand-in judge answering from a table, so the metrics are tested on their own."""

    def __init__(self, answers):
        super().__init__()
        self.answers = list(answers)

    def forward(self, x):
        out = torch.zeros(x.shape[0], 10)
        out[torch.arange(x.shape[0]), torch.tensor(self.answers[: x.shape[0]])] = 1.0
        return out


def test_clip_metrics_on_known_clips():
    smooth = _blob_clip([6 + 2 * f for f in range(8)])  # moving right at 2 px/frame
    jumpy = _blob_clip([6, 20, 8, 22, 6, 20, 8, 22])  # flickers left and right
    frames = np.stack([smooth, jumpy])
    # clip 0: all 3 (the prompt's digit); clip 1: drifts from 3 to 8 half way
    judge = FixedClassifier([3] * 8 + [3] * 4 + [8] * 4)
    m = clip_metrics(judge, frames, [3, 3], ["right", "right"])
    assert (
        m["frame_rate"] == pytest.approx(12 / 16)
        and m["kept"] == 0.5
        and m["consistency"] == pytest.approx(12 / 16)
    )
    assert m["direction"] == 1.0  # both end further right than they began
    single = clip_metrics(FixedClassifier([3] * 8), smooth[None], [3], ["right"])
    assert single["jerk"] == pytest.approx(0.0) and m["jerk"] > 5


def test_analyzer_flops_match_the_model():
    """Oracle: the analyzer's matmul FLOPs = torch's FLOP counter on the real VideoDiTModel (naive attention,
    so the attention matmuls are visible to the counter)."""
    from torch.utils.flop_counter import FlopCounterMode

    from forwardpass.diffusion.video.dit import VideoDiTModel

    for mode in ("full", "factorized"):
        model = VideoDiTModel(hidden_size=256, num_layers=2, num_attention_heads=4, cross_attention_dim=256,
                              mlp_ratio=4.0, attention_mode=mode,
                              attention_backend="naive").eval()  # fmt: skip
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(torch.randn(1, 4, 4, 8, 8), torch.tensor([500.0]), torch.randn(1, 10, 256))
        rep = video_dit_cost(4, 8, 8, hidden=256, depth=2, heads=4, text_len=10, mlp_ratio=4.0, cfg=False,
                             attention=mode)  # fmt: skip
        predicted = sum(o.flops for o in rep.ops if o.kind == MATMUL)
        assert predicted == pytest.approx(counter.get_total_flops(), rel=0.01), mode


def test_attention_share_grows_with_frames_and_batch_one_is_enough():
    shape = {"latent_h": 60, "latent_w": 104, "hidden": 1536, "depth": 28, "heads": 24, "steps": 30}
    rows = frames_sweep([1, 8, 32], **shape)
    full = [r["full"]["attention_share"] for r in rows]
    assert full[0] < full[1] < full[2] and full[2] > 0.8  # quadratic in T·S: attention takes over
    assert all(r["factorized"]["attention_share"] < 0.2 for r in rows)  # T·S² + S·T² stays small
    assert all(r[m]["bound"] == "compute" for r in rows for m in ("full", "factorized"))
    batches = batch_sweep([1, 2, 4], frames=16, **shape)
    assert batches[0]["bound"] == "compute"
    clips = [b["clips_per_s"] for b in batches]
    assert max(clips) / min(clips) < 1.02  # throughput flat ...
    assert batches[2]["latency_s"] == pytest.approx(4 * batches[0]["latency_s"], rel=0.02)  # ... latency ×b


def test_roofline_video_cli(capsys):
    from forwardpass.cli import main

    assert main(["roofline", "video", "--frames", "8", "--latent", "8x8", "--width", "128", "--depth", "4",
                 "--heads", "4", "--text-len", "6", "--cfg", "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert out["tokens_per_clip"] == 8 * 16 and out["step"]["bound"] in ("compute", "memory")
    assert [r["frames"] for r in out["frames_sweep"]] == [1, 4, 8, 16, 32, 64]
    assert main(["roofline", "video", "--frames", "0"]) == 1
    assert main(["roofline", "video", "--frames", "8", "--latent", "60x104", "--brief"]) == 0
    assert "Why batch 1" in capsys.readouterr().out


# ----- the claims (forwardpass/assets/video/README.md), judged by a classifier fit on real handwriting only
# The full measurement is scripts/video_eval_claims.py (200 held-out clips per sampler); CI runs a small
# version of it, the slow test the full one. Frame-by-frame sampling costs 8× the denoiser passes of
# whole-clip sampling, which is what made the previous CI check (150 clips per sampler) take 146 s.
@pytest.fixture(scope="module")
def claims_setup():
    from forwardpass.diffusion.video import DEFAULT_VIDEO_MODEL_DIR
    from forwardpass.diffusion.video.judge import load_judge
    from forwardpass.diffusion.video.pipeline import VideoPipeline

    judge = load_judge(DEFAULT_VIDEO_MODEL_DIR / "judge_mnist_optdigits.npz")
    return VideoPipeline.from_pretrained(DEFAULT_VIDEO_MODEL_DIR), judge


def _claims(pipe, judge, n: int, seed: int, framewise: bool, steps: int = 10) -> dict:
    from forwardpass.diffusion.video.quality import direction_agrees, eval_prompts, generate_clips

    _, digits, dirs = eval_prompts(n)
    clips = generate_clips(pipe, n, framewise=framewise, seed=seed, batch_size=n, num_inference_steps=steps)
    right = judge.predict(clips) == np.asarray(digits)[:, None]
    return {"frames_right": right.mean(), "kept": right.all(1).mean(),
            "direction": direction_agrees(clips, dirs).mean()}  # fmt: skip


# Measured on the shipped model (forwardpass/assets/video/README.md, "The claims, judged independently"). The
# CI bars sit a few clips below the measured figures, for another CPU's rounding.
CI_MEASURED = {"frames_right": 0.9125, "kept": 0.775, "direction": 1.0}  # 40 clips, seed 1000, 10 steps
CI_BARS = {"frames_right": 0.75}
FULL_BARS = {"direction": 0.8, "frames_right": 0.8, "kept_standard_errors": 2.0}  # issue 43's bars


@pytest.fixture(scope="module")
def ci_claims(claims_setup):
    """40 held-out clips (seed 1000: never used in training or selection), whole clip, model defaults."""
    m = _claims(*claims_setup, n=40, seed=1000, framewise=False)
    print(m)
    return m


def test_digit_ci_sized(ci_claims):
    assert ci_claims["frames_right"] >= CI_BARS["frames_right"], ci_claims


def test_direction_honoured_ci_sized(ci_claims):
    """The prompt's direction word is honoured (issue 43's bar; before the DiT's direction input: 25% of
    clips, chance)."""
    assert ci_claims["direction"] >= FULL_BARS["direction"], ci_claims


def test_framewise_baseline_ci_sized(claims_setup):
    """Frame by frame runs the same network: 40 clips, 6 steps; its frames are digits the judge recognises.

    40, not 10: a wrong first frame is copied into all eight, so 10 clips are ~10 draws; after the
    end-weighted fine-tune the first 10 clips gave 42.5% while the first 40 gave 69.7% (the model before it:
    62.5% / 70.3%); at 10 steps on 200 clips frame by frame is 83.4% (forwardpass/assets/video/README.md)."""
    m = _claims(*claims_setup, n=40, seed=1000, framewise=True, steps=6)
    print(m)
    assert m["frames_right"] >= 0.5, m


@pytest.mark.slow
def test_claims_full():
    """scripts/video_eval_claims.py as the README states it: 200 held-out clips per sampler, one network for
    both, against the issue's bars."""
    import subprocess
    import sys

    from tests.helpers.server import REPO

    out = REPO / "forwardpass" / "assets" / "video" / "claims_eval.json"
    tmp = out.with_name("claims_eval.test.json")
    subprocess.run([sys.executable, "scripts/video_eval_claims.py", "--json", str(tmp)], cwd=REPO, check=True,
                   timeout=3600)  # fmt: skip
    try:
        res = json.loads(tmp.read_text())
    finally:
        tmp.unlink(missing_ok=True)
    whole, diff = res["whole"], res["kept_difference"]
    assert whole["clips"] == res["framewise"]["clips"] == 200
    assert whole["direction"] >= FULL_BARS["direction"], whole
    assert whole["frames_right"] >= FULL_BARS["frames_right"], whole
    assert diff["standard_errors"] >= FULL_BARS["kept_standard_errors"], diff
