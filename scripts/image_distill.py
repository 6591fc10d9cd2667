"""Few-step student distillation and pipeline-folder assembly for scripts/train_default_image.py.

The student is a DiT of the teacher's shape, initialised from the teacher, trained so that under
``LCMScheduler`` (predict x̂₀, re-noise to the next timestep, repeat) it reproduces where the teacher's
*guided* probability-flow ODE ends. Training pairs (input state at LCM timestep t → teacher endpoint):

* t = 999 (the first step of every schedule): input is the pipeline's initial noise ε itself, target is
  the teacher's guided ODE solution from ε;
* t < 999: input is what the sampler actually feeds the student there — a teacher sample re-noised with
  fresh noise, ``(1−σ_t)·x₀ + σ_t·z`` — and the target is the teacher's ODE solution from that point.

So guidance is baked in (the student runs without CFG) and the student is consistent on exactly the
states the few-step sampler visits. Loss: MSE between the student's x̂₀ and the target, in latent space.
"""

from __future__ import annotations

import copy
import json
import logging
import random
import time
from pathlib import Path

import torch

from forwardpass.diffusion.loading import save_scheduler
from forwardpass.diffusion.pipeline import ImagePipeline
from forwardpass.diffusion.schedulers import FlowMatchEulerDiscreteScheduler, LCMScheduler

log = logging.getLogger("train_image")

TEACHER_DEFAULTS = {"num_inference_steps": 30, "guidance_scale": 4.0, "height": 32, "width": 32}
STUDENT_DEFAULTS = {"num_inference_steps": 4, "guidance_scale": 1.0}


def student_scheduler() -> LCMScheduler:
    return LCMScheduler(prediction_type="sample")


def write_model_index(out: Path, *, with_student: bool, guidance: float) -> None:
    save_scheduler(FlowMatchEulerDiscreteScheduler(shift=1.0), out / "scheduler")
    index = {
        "_class_name": "ImagePipeline",
        "_forwardpass": "forwardpass.diffusion.pipeline.ImagePipeline",
        "text_encoder": ["forwardpass", "TinyTextEncoder"],
        "tokenizer": ["forwardpass", "PromptTokenizer"],
        "transformer": ["forwardpass", "DiTTransformer2DModel"],
        "vae": ["forwardpass", "TinyAutoencoderKL"],
        "scheduler": ["forwardpass", "FlowMatchEulerDiscreteScheduler"],
        "forwardpass_defaults": {**TEACHER_DEFAULTS, "guidance_scale": guidance},
    }
    if with_student:
        save_scheduler(student_scheduler(), out / "student_scheduler")
        index["student_transformer"] = ["forwardpass", "DiTTransformer2DModel"]
        index["student_scheduler"] = ["forwardpass", "LCMScheduler"]
        index["forwardpass_few_step_defaults"] = dict(STUDENT_DEFAULTS)
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")


def flow_sigma(sched: LCMScheduler, t: int) -> float:
    ab = sched.alphas_cumprod[t]
    a, s = ab.sqrt(), (1 - ab).sqrt()
    return float(s / (a + s))


@torch.no_grad()
def teacher_ode(pipe: ImagePipeline, x: torch.Tensor, sigma_from: float, ctx, mask, guidance: float,
                steps: int) -> torch.Tensor:  # fmt: skip
    """Integrate the guided flow ODE from σ = ``sigma_from`` to 0 with Euler (``ctx``
    holds [uncond; cond])."""
    n = max(2, round(steps * sigma_from))
    sigmas = torch.linspace(sigma_from, 0.0, n + 1)
    for i in range(n):
        v = pipe.transformer(torch.cat([x, x]), (sigmas[i] * 1000).expand(2 * len(x)), ctx, mask)
        u, c = v.chunk(2)
        x = x + (sigmas[i + 1] - sigmas[i]) * (u + guidance * (c - u))
    return x


def stage_student(data, args, work: Path) -> None:
    from train_default_image import caption, ink_buckets, record_time

    out = Path(args.out)
    write_model_index(out, with_student=False, guidance=args.guidance)
    t0 = time.time()
    pipe = ImagePipeline.from_pretrained(out)
    lcm = student_scheduler()
    ts = set()
    for n in range(1, 5):
        lcm.set_timesteps(n)
        ts |= {int(t) for t in lcm.timesteps}
    ts_list = sorted(ts, reverse=True)
    log.info("student timesteps %s, flow sigmas %s", ts_list, [round(flow_sigma(lcm, t), 3) for t in ts_list])

    pairs_path = work / "distill_pairs.pt"
    x, y = data["gen_train"]
    buckets = ink_buckets(x, y)
    rng = random.Random(1)
    g = torch.Generator().manual_seed(1)
    if pairs_path.exists():
        pairs = torch.load(pairs_path)
    else:
        # Captions drawn like the training captions (digit and thickness from real training images).
        def captions(k):
            idx = torch.randint(0, len(y), (k,), generator=g)
            return [caption(int(y[i]), int(buckets[i]), rng) for i in idx]

        def encode(caps):
            ctx, mask = pipe.encode_prompt([""] * len(caps) + caps)
            return ctx, mask

        inputs, targets, tvals, caps_all = [], [], [], []
        bs = args.distill_batch
        n_full = args.student_trajectories
        for start in range(0, n_full, bs):  # pure-noise starts (t = 999)
            caps = captions(bs)
            eps = torch.randn(bs, 4, 8, 8, generator=g)
            ctx, mask = encode(caps)
            x0 = teacher_ode(pipe, eps, 1.0, ctx, mask, args.guidance, args.distill_teacher_steps)
            inputs.append(eps)
            targets.append(x0)
            tvals += [ts_list[0]] * bs
            caps_all += caps
            log.info("distill pairs t=999: %d/%d (%.0f s)", start + bs, n_full, time.time() - t0)
        clean = torch.cat(targets)
        clean_caps = list(caps_all)
        for t in ts_list[1:]:  # re-noised teacher samples (t < 999), as the LCM sampler makes them
            sigma = flow_sigma(lcm, t)
            for _ in range(0, args.student_renoised, bs):
                idx = torch.randint(0, len(clean), (bs,), generator=g)
                caps = [clean_caps[i] for i in idx]
                z = torch.randn(bs, 4, 8, 8, generator=g)
                xt = (1 - sigma) * clean[idx] + sigma * z
                ctx, mask = encode(caps)
                x0 = teacher_ode(pipe, xt, sigma, ctx, mask, args.guidance, args.distill_teacher_steps)
                # Store the state in the scheduler's (VP) coordinates, exactly what the student will be fed.
                ab = lcm.alphas_cumprod[t]
                inputs.append(xt * (ab.sqrt() + (1 - ab).sqrt()))
                targets.append(x0)
                tvals += [t] * bs
                caps_all += caps
            log.info("distill pairs t=%d done (%.0f s)", t, time.time() - t0)
        pairs = {"x": torch.cat(inputs), "x0": torch.cat(targets), "t": torch.tensor(tvals), "caps": caps_all}
        torch.save(pairs, pairs_path)
    gen_time = time.time() - t0
    log.info("distillation pairs: %d in %.0f s", len(pairs["t"]), gen_time)

    # Train the student: init from the teacher, text encoder frozen (shared with the teacher).
    with torch.no_grad():
        ctx_all, mask_all = [], []
        for i in range(0, len(pairs["caps"]), 1024):
            c, m = pipe.encode_prompt(pairs["caps"][i : i + 1024])
            pad = pipe.text_encoder.config["max_position_embeddings"] - c.shape[1]
            ctx_all.append(torch.nn.functional.pad(c, (0, 0, 0, pad)))
            mask_all.append(torch.nn.functional.pad(m, (0, pad)))
        ctx_all, mask_all = torch.cat(ctx_all), torch.cat(mask_all)
    student = copy.deepcopy(pipe.transformer).train()
    ema = copy.deepcopy(student).eval()
    opt = torch.optim.AdamW(student.parameters(), lr=args.student_lr, weight_decay=0.0)
    ab = lcm.alphas_cumprod
    n_pairs = len(pairs["t"])
    ckpt = work / "student.pt"
    step = 0
    if ckpt.exists():
        st = torch.load(ckpt, weights_only=False)
        student.load_state_dict(st["student"]), ema.load_state_dict(st["ema"]), opt.load_state_dict(st["opt"])
        step = st["step"]
        log.info("resumed student at step %d", step)
    t1 = time.time()
    total = args.student_steps
    while step < total:
        for grp in opt.param_groups:
            grp["lr"] = args.student_lr * min(1.0, (step + 1) / 100)
        idx = torch.randint(0, n_pairs, (128,))
        t = pairs["t"][idx]
        a, s = ab[t].sqrt()[:, None, None, None], (1 - ab[t]).sqrt()[:, None, None, None]
        sigma = s / (a + s)
        x_flow = pairs["x"][idx] / (a + s)  # the pipeline's VP → flow mapping
        v = student(x_flow, sigma.flatten() * 1000, ctx_all[idx], mask_all[idx])
        loss = (x_flow - sigma * v - pairs["x0"][idx]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            d = min(args.ema, (1 + step) / (10 + step))
            for pe, pm in zip(ema.parameters(), student.parameters()):
                pe.lerp_(pm, 1 - d)
        step += 1
        if step % 50 == 0:
            log.info(
                "student step %d/%d loss %.4f (%.2f s/step)",
                step,
                total,
                loss.item(),
                (time.time() - t1) / 50,
            )
            t1 = time.time()
        if step % 250 == 0 or step == total:
            torch.save({"student": student.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                        "step": step}, ckpt)  # fmt: skip
    ema.save_pretrained(out / "student_transformer", half=args.half)
    write_model_index(out, with_student=True, guidance=args.guidance)
    record_time(work, "student", time.time() - t0, pair_generation_s=round(gen_time, 1), pairs=n_pairs,
                steps=total, guidance_baked=args.guidance)  # fmt: skip


def stage_assemble(args, work: Path) -> None:
    out = Path(args.out)
    write_model_index(out, with_student=(out / "student_transformer").exists(), guidance=args.guidance)
    log.info("wrote %s", out / "model_index.json")
