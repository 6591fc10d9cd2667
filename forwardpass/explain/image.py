"""``forwardpass explain-image``: the diffusion side, from real runs of the image pipeline.

For the teacher (many steps, classifier-free guidance) and the few-step student, with the same prompt
and seed: the latent decoded at chosen steps (a strip: the image resolving), the denoiser forward-pass
counter (two passes per step with CFG — the unconditional and conditional halves of one batch), and the
per-step roofline: the step's FLOPs and bytes from ``analysis/diffusion.dit_cost`` next to its measured
time. The pipeline is used as it is; its ``callback_on_step_end`` call argument hands over each step's
latents, which are copied and decoded with the pipeline's own VAE after the run (so decoding does not
count in the step times).
"""

from __future__ import annotations

import base64
import io
import time
from pathlib import Path
from typing import Any

import torch


def _png(img: Any, scale: int = 4) -> bytes:
    buf = io.BytesIO()
    img.resize((img.width * scale, img.height * scale), resample=0).save(buf, format="PNG")
    return buf.getvalue()


def _run(root: Path, prompt: str, *, few_step: bool, steps: int | None, guidance: float | None, seed: int,
         frames: int, hw: Any, overhead: Any = None) -> dict[str, Any]:
    from forwardpass.analysis.diffusion import dit_cost
    from forwardpass.diffusion.images import to_numpy, to_pil
    from forwardpass.diffusion.pipeline import ImagePipeline

    pipe = ImagePipeline.from_pretrained(root, few_step=few_step)
    n_steps = pipe.defaults["num_inference_steps"] if steps is None else steps
    g = pipe.defaults["guidance_scale"] if guidance is None else guidance
    cfg = g > 1.0
    latents: list[tuple[int, float, torch.Tensor]] = []
    times: list[float] = []
    cpu: list[float] = []  # the process's CPU seconds over each step (analysis/regime.py: the cause)
    mark = [0.0, 0.0]

    def on_step(p: Any, i: int, t: Any, kw: dict[str, Any]) -> None:
        times.append(time.perf_counter() - mark[0])
        cpu.append(time.process_time() - mark[1])
        latents.append((i, float(t), kw["latents"].detach().clone()))
        mark[:] = [time.perf_counter(), time.process_time()]  # the copy is not part of the next step

    mark[:] = [time.perf_counter(), time.process_time()]
    image = pipe(prompt, num_inference_steps=n_steps, guidance_scale=g, seed=seed, show_progress=False,
                 callback_on_step_end=on_step).images[0]
    cfgt = pipe.transformer.config
    h, w = latents[0][2].shape[-2:]
    cost = dit_cost(h, w, cfgt["in_channels"], cfgt["patch_size"], cfgt["hidden_size"], cfgt["num_layers"],
                    cfgt["num_attention_heads"], pipe.tokenizer.max_length, cfgt["mlp_ratio"], n_steps, cfg,
                    hardware=hw, weight_dtype="fp32")
    st = cost.step
    pps = 2 if cfg else 1
    from forwardpass.analysis.overhead import stage_with_overhead
    from forwardpass.analysis.regime import classify

    oh_s = overhead.time_s(cfgt["num_layers"]) if overhead is not None else 0.0
    predicted, bound = stage_with_overhead(st.time_s, st.bound, oh_s)
    if n_steps <= frames:
        show = set(range(n_steps))
    else:  # evenly spaced, first and last included
        show = {round(k * (n_steps - 1) / max(1, frames - 1)) for k in range(frames)}
    strip = []
    with torch.no_grad():
        for i, t, lat in latents:
            if i in show:
                img = to_pil(to_numpy(pipe.vae.decode(lat)))[0]
                strip.append({"step": i + 1, "t": t, "latent_std": float(lat.std()), "image": img})
    return {
        "name": "student (few-step)" if few_step else "teacher",
        "scheduler": type(pipe.scheduler).__name__, "steps": n_steps, "guidance": g, "cfg": cfg,
        "passes_per_step": pps, "forward_passes": n_steps * pps,
        "per_step": [
            {"step": i + 1, "t": t, "passes": pps, "passes_total": (i + 1) * pps, "time_s": dt,
             "flops": st.flops, "bytes": st.bytes, "intensity": st.intensity,
             "achieved_flops_per_s": st.flops / dt if dt else 0.0, "roofline_s": st.time_s,
             "overhead_s": oh_s, "predicted_s": predicted, "bound": bound,
             **classify(dt, predicted, bound, cpu_s=c).to_dict()}
            for (i, t, _), dt, c in zip(latents, times, cpu)
        ],
        "strip": strip,
        "image": image,
        "note": "step 1's time includes the text encoder and the initial noise",
    }


def explain_image(prompt: str, *, model: str | Path | None = None, seed: int = 0, steps: int | None = None,
                  guidance: float | None = None, student_steps: int | None = None, frames: int = 8,
                  hardware: Any = "this-machine", overhead: Any = "this-machine") -> dict[str, Any]:
    """Teacher and few-step student on ``prompt`` (same seed); images are PIL in ``strip``/``image``.

    ``overhead`` (the engine's measured per-step and per-layer overhead, ``analysis/overhead.py``) is added
    to each step's roofline prediction: a denoiser step of the embedded model is overhead-bound too."""
    from forwardpass.analysis.hardware import get_hardware
    from forwardpass.analysis.overhead import resolve_overhead
    from forwardpass.diffusion import DEFAULT_MODEL_DIR

    root = Path(model) if model else DEFAULT_MODEL_DIR
    hw = get_hardware(hardware)
    oh = resolve_overhead(overhead)
    runs = [_run(root, prompt, few_step=False, steps=steps, guidance=guidance, seed=seed, frames=frames,
                 hw=hw, overhead=oh)]
    try:
        runs.append(_run(root, prompt, few_step=True, steps=student_steps, guidance=None, seed=seed,
                         frames=frames, hw=hw, overhead=oh))
    except Exception as exc:  # noqa: BLE001 - a pipeline without a student: the teacher alone
        runs[0]["student_error"] = str(exc)
    return {"prompt": prompt, "seed": seed, "hardware": hw.to_dict("fp32"),
            "overhead": oh.to_dict() if oh is not None else None, "runs": runs}


def to_json(ex: dict[str, Any]) -> dict[str, Any]:
    """The explanation without the images."""
    runs = [{**{k: v for k, v in r.items() if k not in ("strip", "image")},
             "strip": [{k: v for k, v in f.items() if k != "image"} for f in r["strip"]]} for r in ex["runs"]]
    return {**ex, "runs": runs}


def strip_image(ex: dict[str, Any], scale: int = 4) -> Any:
    """One PNG-ready image: a row per run, its decoded frames left to right, the final image last."""
    from PIL import Image

    rows = [[f["image"] for f in r["strip"]] + [r["image"]] for r in ex["runs"]]
    w, h = rows[0][0].width * scale, rows[0][0].height * scale
    cols = max(len(r) for r in rows)
    out = Image.new("RGB", (cols * (w + 4), len(rows) * (h + 4)), "white")
    for y, row in enumerate(rows):
        for x, img in enumerate(row):
            out.paste(img.convert("RGB").resize((w, h), resample=0), (x * (w + 4), y * (h + 4)))
    return out


def render_image_html(ex: dict[str, Any]) -> str:
    from forwardpass.analysis.report import fmt_flops, fmt_time
    from forwardpass.explain.html import _CSS, _e

    parts = [(f"<!doctype html><html><head><meta charset=utf-8><title>forwardpass explain-image</title>"
             f"<style>{_CSS} img{{image-rendering:pixelated;margin:2px}}</style></head><body>"),
             f"<h1>forwardpass explain-image · {_e(ex['prompt'])}</h1>"]
    for r in ex["runs"]:
        parts.append(f"<h2>{_e(r['name'])}: {r['steps']} steps of {_e(r['scheduler'])}, guidance "
                     f"{r['guidance']} — {r['forward_passes']} denoiser passes ({r['passes_per_step']} per "
                     "step)</h2><div>")
        for f in [*r["strip"], {"step": "final", "image": r["image"]}]:
            b64 = base64.b64encode(_png(f["image"])).decode()
            parts.append(f'<figure style="display:inline-block;margin:4px"><img alt="step {f["step"]}" '
                         f'src="data:image/png;base64,{b64}"><figcaption>step {f["step"]}</figcaption>'
                         '</figure>')
        parts.append("</div><table><tr><th>step</th><th>t</th><th>passes so far</th><th>time</th>"
                     "<th>FLOPs</th><th>predicted</th><th>bound</th></tr>")
        for s in r["per_step"]:
            parts.append(f"<tr><td>{s['step']}</td><td>{s['t']:.1f}</td><td>{s['passes_total']}</td>"
                         f"<td>{fmt_time(s['time_s'])}</td><td>{fmt_flops(s['flops'])}</td>"
                         f"<td>{fmt_time(s['predicted_s'])}</td><td>{s['bound']}</td></tr>")
        parts.append("</table>")
    parts.append("</body></html>")
    return "".join(parts)
