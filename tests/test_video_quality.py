"""Drift measurement (metrics and the fast whole-clip vs frame-by-frame evaluation) and the video analyzer."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from forwardpass.analysis.ops import MATMUL
from forwardpass.analysis.video import batch_sweep, frames_sweep, video_dit_cost
from forwardpass.diffusion.video.quality import centres, clip_metrics, recentre


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


# ----- the claim: whole-clip generation keeps the prompted digit more often than frame by frame -----------
def _drift(n: int, steps: int, seeds: list[int]) -> dict[str, dict]:
    """Both samplers on the same ``n`` prompts once per seed, the clips pooled (``n × len(seeds)`` each)."""
    from forwardpass.diffusion import DEFAULT_MODEL_DIR
    from forwardpass.diffusion.quality import load_classifier
    from forwardpass.diffusion.video import DEFAULT_VIDEO_MODEL_DIR
    from forwardpass.diffusion.video.pipeline import VideoPipeline
    from forwardpass.diffusion.video.quality import clip_metrics, eval_prompts, generate_clips

    torch.set_num_threads(1)
    pipe = VideoPipeline.from_pretrained(DEFAULT_VIDEO_MODEL_DIR)
    judge = load_classifier(DEFAULT_MODEL_DIR / "eval_classifier")
    _, digits, dirs = eval_prompts(n)
    out = {}
    for name, framewise in (("whole", False), ("framewise", True)):
        clips = [generate_clips(pipe, n, framewise=framewise, seed=seed, batch_size=n,
                                num_inference_steps=steps)
                 for seed in seeds]  # fmt: skip
        out[name] = clip_metrics(judge, np.concatenate(clips), digits * len(seeds), dirs * len(seeds))
    return out


def test_fast_drift_evaluation():
    """The fast version of scripts/video_eval_drift.py: 30 clips (3 per digit) × 5 seeds, 6 steps, the model's
    CFG 5, whole clip and frame by frame with the same model, prompts and seeds.

    Shipped model here: whole clip keeps the digit in every frame in 60% of the 150 clips, frame by frame in
    53% (per seed 47/70/63/60/60% vs 53/47/50/57/60%: one seed alone does not separate them, hence the pool);
    frames recognised 87% vs 76%. The full evaluation (350 clips, 10 steps; and 16-frame clips) is in
    forwardpass/assets/video/README.md. The margins leave room for another CPU's rounding (a few clips)."""
    res = _drift(30, 6, [0, 1, 2, 3, 4])
    for name, m in res.items():
        assert m["clips"] == 150 and len(m["frame_rate_by_position"]) == 8
        # the judge recognises generated digits far above chance (10%)
        assert m["frame_rate"] > 0.5, (name, m)
    whole, framewise = res["whole"], res["framewise"]
    print(f"kept: whole clip {whole['kept']:.1%} vs frame by frame {framewise['kept']:.1%}; frames "
          f"recognised {whole['frame_rate']:.1%} vs {framewise['frame_rate']:.1%}")  # fmt: skip
    assert whole["kept"] >= framewise["kept"] + 0.03
    assert whole["frame_rate"] >= framewise["frame_rate"] + 0.05
    assert whole["consistency"] > framewise["consistency"]
