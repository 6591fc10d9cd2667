#!/usr/bin/env python
"""Measure the embedded image model: recognition rate of generated digits, inference time, sample grids.

    python scripts/image_eval_quality.py                 # 200 images per setting, writes JSON + grids
    python scripts/image_eval_quality.py --n 100 --guidance 2 3 4 5   # guidance sweep for the teacher

The judge is forwardpass/assets/image/eval_classifier (a CNN trained on real MNIST digits held out from
generator training; its own accuracy on held-out real test digits is in its metrics.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from forwardpass.diffusion import DEFAULT_MODEL_DIR
from forwardpass.diffusion.images import make_image_grid
from forwardpass.diffusion.pipeline import ImagePipeline
from forwardpass.diffusion.quality import DIGIT_WORDS, load_classifier, recognition_rate, recognition_stats


def time_per_image(pipe: ImagePipeline, repeats: int = 5, **kw) -> float:
    pipe("a handwritten 7", seed=0, show_progress=False, **kw)  # warm-up
    start = time.perf_counter()
    for i in range(repeats):
        pipe("a handwritten 7", seed=i, show_progress=False, **kw)
    return (time.perf_counter() - start) / repeats


def grid(pipe: ImagePipeline, path: Path, cols: int = 8, **kw) -> None:
    images = []
    for d in range(10):
        images += pipe(f"a handwritten {DIGIT_WORDS[d]}", num_images_per_prompt=cols, seed=100 + d,
                       show_progress=False, **kw).images  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    make_image_grid(images, rows=10, cols=cols).resize(((cols * 34 + 2) * 2, (10 * 34 + 2) * 2), 0).save(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    ap.add_argument("--n", type=int, default=200, help="generated images per setting")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--guidance", type=float, nargs="*", default=None, help="sweep teacher guidance and exit")
    ap.add_argument("--steps", type=int, default=None, help="teacher steps for the sweep")
    ap.add_argument("--json", default=str(ROOT / "docs" / "images" / "digits_quality.json"))
    ap.add_argument("--no-grids", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clf = load_classifier(Path(args.model) / "eval_classifier")
    teacher = ImagePipeline.from_pretrained(args.model)

    if args.guidance:
        for g in args.guidance:
            r = recognition_rate(teacher, clf, n=args.n, guidance_scale=g, num_inference_steps=args.steps)
            print(f"teacher guidance {g}: {r:.3f}", flush=True)
        return

    student = ImagePipeline.from_pretrained(args.model, few_step=True)
    steps_default = teacher.defaults["num_inference_steps"]
    results: dict[str, dict[str, float]] = {}
    settings = [
        (f"teacher_{steps_default}_steps", teacher, {}),
        ("teacher_4_steps", teacher, {"num_inference_steps": 4}),
        ("student_1_step", student, {"num_inference_steps": 1}),
        ("student_2_steps", student, {"num_inference_steps": 2}),
        ("student_4_steps", student, {"num_inference_steps": 4}),
    ]
    for name, pipe, kw in settings:
        t0 = time.perf_counter()
        results[name] = recognition_stats(pipe, clf, n=args.n, **kw)
        print(f"{name}: {results[name]['rate']:.3f} recognized, mean p(requested digit) "
              f"{results[name]['confidence']:.3f} ({time.perf_counter() - t0:.1f} s for {args.n})",
              flush=True)  # fmt: skip
    timing = {
        f"teacher_{steps_default}_steps_s_per_image": time_per_image(teacher),
        "student_4_steps_s_per_image": time_per_image(student, num_inference_steps=4),
    }
    print(json.dumps(timing, indent=2))
    clf_metrics = json.loads((Path(args.model) / "eval_classifier" / "metrics.json").read_text())
    report = {"n_images": args.n, "results": results, "timing_batch1_threads": args.threads, **timing,
              "classifier_real_test_accuracy": clf_metrics["real_test_accuracy"],
              "teacher_defaults": teacher.defaults, "student_defaults": student.defaults}  # fmt: skip
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if not args.no_grids:
        grid(teacher, ROOT / "docs" / "images" / "digits_grid.png")
        grid(student, ROOT / "docs" / "images" / "digits_grid_student.png", num_inference_steps=4)
        print("wrote docs/images/digits_grid.png and digits_grid_student.png")


if __name__ == "__main__":
    main()
