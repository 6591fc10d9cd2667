"""The scheduler and guidance tables of forwardpass/assets/image/README.md (issue 22).

    python scripts/image_eval_schedulers.py            # ~10 min on one busy core; writes the JSON below
Writes docs/images/digits_schedulers_guidance.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from forwardpass import ImagePipeline
from forwardpass.diffusion import DEFAULT_MODEL_DIR
from forwardpass.diffusion.quality import eval_prompts, load_classifier

N = 200
CONFUSABLE = {0: 6, 1: 7, 2: 7, 3: 8, 4: 9, 5: 6, 6: 5, 7: 1, 8: 3, 9: 4}
OUT = Path(__file__).resolve().parents[1] / "docs" / "images" / "digits_schedulers_guidance.json"


def judge(pipe, classifier, prompts, labels, negatives=None, **kw) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    correct, prob = 0, 0.0
    for st in range(0, len(prompts), 50):
        out = pipe(prompts[st:st + 50], negative_prompt=negatives[st:st + 50] if negatives else None,
                   generator=gen, output_type="np", show_progress=False, **kw).images
        x = torch.from_numpy(np.ascontiguousarray(out)).float().permute(0, 3, 1, 2)
        with torch.no_grad():
            p = classifier(x).softmax(-1)
        want = torch.tensor(labels[st:st + 50])
        correct += int((p.argmax(-1) == want).sum())
        prob += float(p[torch.arange(len(want)), want].sum())
    return {"rate": correct / len(prompts), "confidence": round(prob / len(prompts), 4)}


def main() -> None:
    torch.set_num_threads(1)
    classifier = load_classifier(DEFAULT_MODEL_DIR / "eval_classifier").eval()
    prompts, labels = eval_prompts(N)
    negatives = [str(CONFUSABLE[d]) for d in labels]
    rows: dict[str, list] = {"schedulers": [], "guidance": []}
    for model, sched, steps in [("teacher", None, 30), ("teacher", "ddim", 30), ("teacher", "ddim", 25),
                                ("teacher", "lcm", 30), ("teacher", "lcm", 8), ("teacher", None, 4),
                                ("teacher", "ddim", 4), ("student", None, 4), ("student", "ddim", 4),
                                ("student", "flow_match", 4)]:
        pipe = ImagePipeline.from_pretrained(DEFAULT_MODEL_DIR, few_step=model == "student", scheduler=sched)
        row = {"model": model, "scheduler": type(pipe.scheduler).__name__, "steps": steps,
               **judge(pipe, classifier, prompts, labels, num_inference_steps=steps)}
        rows["schedulers"].append(row)
        print(row, flush=True)
    pipe = ImagePipeline.from_pretrained(DEFAULT_MODEL_DIR)
    for g in (1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0):
        for negative, mode, rescale in [(False, "replace", 0.0), (False, "replace", 0.7),
                                        (True, "replace", 0.0), (True, "replace", 0.7), (True, "perp", 0.0)]:
            if g == 1.0 and (negative or rescale):
                continue
            row = {"guidance": g, "rescale": rescale, "negative": "confusable digit" if negative else "none",
                   "negative_mode": mode,
                   **judge(pipe, classifier, prompts, labels, negatives if negative else None,
                           guidance_scale=g, guidance_rescale=rescale, negative_mode=mode,
                           num_inference_steps=30)}
            rows["guidance"].append(row)
            print(row, flush=True)
    OUT.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
