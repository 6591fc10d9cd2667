"""Distil a small draft model for the embedded default LLM (speculative decoding, method ``draft_model``).

The draft is a 3-layer Qwen3ForCausalLM with the target's tokenizer (vocab 4096), trained to match the
target's next-token distribution (forward KL from the target's softmax, plus a little cross-entropy on the
text) on the same training stream the target saw. Its tied embedding starts from the target's, projected
to the draft's width by SVD, which gets it to useful acceptance in minutes rather than hours.

    # 0./1. the target's data (the same corpus, split and token ids as the target)
    apt-get download r-cran-janeaustenr && dpkg -x r-cran-janeaustenr_*.deb /tmp/ja
    python scripts/train_default_llm.py prepare --austen-root /tmp/ja --work /tmp/fp_draft
    # 2. distil (resumable: rerunning continues from the last checkpoint)
    nice -n 10 python scripts/train_draft_llm.py train --work /tmp/fp_draft --max-minutes 40
    # 3. write forwardpass/assets/llm_draft (config, fp32 safetensors, the target's tokenizer files)
    python scripts/train_draft_llm.py export --work /tmp/fp_draft

Greedy agreement with the target (the acceptance rate a greedy verifier sees) is logged on held-out text
with each evaluation.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
TARGET_DIR = REPO / "forwardpass" / "assets" / "llm"
DEFAULT_OUT = REPO / "forwardpass" / "assets" / "llm_draft"
DEFAULT_WORK = Path("/tmp/fp_draft")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")

# ~1.1M parameters: 4.5 MB in fp32 (the embedding, tied to the LM head, is 0.52M of them).
DRAFT = {
    "vocab_size": 4096,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}


def _base():
    """scripts/train_default_llm.py as a module: its batches, LR schedule, logging and constants."""
    spec = importlib.util.spec_from_file_location("train_default_llm",
                                                  REPO / "scripts" / "train_default_llm.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


BASE = _base()
log = BASE.log


def load_target():
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(TARGET_DIR, torch_dtype=torch.float32,
                                             attn_implementation="sdpa")
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def build_draft(seed: int, target=None):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(**DRAFT, bos_token_id=BASE.EOT, eos_token_id=BASE.IM_END, pad_token_id=BASE.EOT,
                      attn_implementation="sdpa")
    model = Qwen3ForCausalLM(cfg)
    if target is not None:
        # The target's embedding rows, projected onto their top principal directions: token similarity
        # is kept, so the draft starts knowing which tokens behave alike. Rescaled to the init's norm.
        emb = target.get_input_embeddings().weight.detach()
        u, s, _ = torch.linalg.svd(emb, full_matrices=False)
        proj = u[:, : DRAFT["hidden_size"]] * s[: DRAFT["hidden_size"]]
        ref = model.get_input_embeddings().weight
        with torch.no_grad():
            ref.copy_(proj * (ref.norm() / proj.norm()))
    return model


def distil_loss(student_logits, teacher_logits, labels, ce_weight: float):
    """Forward KL(p_target || q_draft) per token, plus ``ce_weight`` x cross-entropy on the text."""
    logq = F.log_softmax(student_logits.float(), dim=-1)
    p = F.softmax(teacher_logits.float(), dim=-1)
    kl = (p * (torch.log(p.clamp_min(1e-30)) - logq)).sum(-1).mean()
    ce = F.nll_loss(logq.reshape(-1, logq.shape[-1]), labels.reshape(-1))
    return kl + ce_weight * ce, kl, ce


@torch.no_grad()
def evaluate(student, target, ids: np.ndarray, seq_len: int, max_tokens: int) -> dict[str, float]:
    """Held-out KL, and how often the draft's argmax equals the target's (greedy acceptance per token)."""
    student.eval()
    n = min(len(ids), max_tokens)
    kl_sum, agree, cnt = 0.0, 0, 0
    for s in range(0, n - 1, seq_len):
        x = torch.from_numpy(ids[s : min(s + seq_len, n)].astype(np.int64))[None]
        if x.shape[1] < 2:
            break
        sl, tl = student(input_ids=x).logits[0], target(input_ids=x).logits[0]
        _, kl, _ = distil_loss(sl, tl, x[0], 0.0)
        kl_sum += kl.item() * x.shape[1]
        agree += int((sl.argmax(-1) == tl.argmax(-1)).sum())
        cnt += x.shape[1]
    student.train()
    return {"kl": kl_sum / cnt, "agree": agree / cnt}


def cmd_train(args) -> None:
    torch.set_num_threads(args.threads)
    work: Path = args.work
    ids = np.load(work / "train_ids.npy")
    held = np.load(work / "heldout_ids.npy")
    target = load_target()
    model = build_draft(args.seed, target)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"draft {n_params:,} params ({n_params * 4 / 1e6:.2f} MB fp32); train tokens {len(ids):,}")
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    ckpt = work / "draft_ckpt.pt"
    step, elapsed_before, decay_start, total = 0, 0.0, None, args.steps
    if ckpt.exists():
        st = torch.load(ckpt, map_location="cpu", weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, elapsed_before = st["step"], st["elapsed"]
        decay_start, total = st.get("decay_start"), st.get("total", args.steps)
        log(f"resumed from step {step} ({elapsed_before / 60:.1f} min trained)")
    else:
        log(f"step 0 held-out {evaluate(model, target, held, args.seq_len, args.eval_tokens)}")

    t0 = time.time()

    def save() -> None:
        tmp = work / "draft_ckpt.pt.tmp"
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                    "decay_start": decay_start, "total": total, "elapsed": elapsed_before + time.time() - t0,
                    "args": {k: str(v) for k, v in vars(args).items()}}, tmp)
        os.replace(tmp, ckpt)

    model.train()
    t_log, tok_log, acc, n_acc, step0 = time.time(), 0, [0.0, 0.0], 0, step
    while step < total:
        elapsed = elapsed_before + time.time() - t0
        if elapsed > args.max_minutes * 60 * 1.1:
            log(f"time budget of {args.max_minutes} min (+10%) exceeded at step {step}; stopping")
            break
        if decay_start is None and step > step0 and elapsed >= args.max_minutes * 60 * (1 - args.decay_frac):
            step_time = (time.time() - t0) / (step - step0)
            decay_start = step
            total = min(args.steps, step + max(1, round(args.max_minutes * 60 * args.decay_frac / step_time)))
            log(f"starting LR decay at step {decay_start}: {total - step} decay steps "
                f"({step_time:.2f} s/step)")
        lr = BASE.lr_at(step, args, decay_start, total)
        for grp in opt.param_groups:
            grp["lr"] = lr
        x = BASE.get_batch(ids, step, args)
        with torch.no_grad():
            teacher = target(input_ids=x[:, :-1]).logits
        loss, kl, ce = distil_loss(model(input_ids=x[:, :-1]).logits, teacher, x[:, 1:], args.ce_weight)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        acc[0] += kl.item()
        acc[1] += ce.item()
        n_acc += 1
        tok_log += x.numel()
        if step % args.log_every == 0 or step == total:
            dt = time.time() - t_log
            log(f"step {step}/{total if decay_start is not None else '?'} kl {acc[0] / n_acc:.4f} ce "
                f"{acc[1] / n_acc:.4f} lr {lr:.2e} gnorm {gnorm:.2f} {tok_log / dt:.0f} tok/s elapsed "
                f"{(elapsed_before + time.time() - t0) / 60:.1f} min")
            t_log, tok_log, acc, n_acc = time.time(), 0, [0.0, 0.0], 0
        if step % args.eval_every == 0 or step == total:
            log(f"step {step} held-out {evaluate(model, target, held, args.seq_len, args.eval_tokens)}")
        if step % args.ckpt_every == 0 or step == total:
            save()
    save()
    log(f"done: step {step}, {(elapsed_before + time.time() - t0) / 60:.1f} min of training in all")


def cmd_export(args) -> None:
    work: Path = args.work
    out: Path = args.out
    st = torch.load(work / "draft_ckpt.pt", map_location="cpu", weights_only=False)
    model = build_draft(args.seed)
    model.load_state_dict(st["model"])
    BASE.save_model_dir(model, out)
    for name in TOKENIZER_FILES:  # the very same tokenizer files as the target: one vocabulary
        shutil.copyfile(TARGET_DIR / name, out / name)
    held = np.load(work / "heldout_ids.npy")
    metrics = evaluate(model, load_target(), held, args.seq_len, len(held))
    meta = {"trained_steps": st["step"], "train_minutes": round(st["elapsed"] / 60, 1), "heldout": metrics}
    (work / "draft_export_meta.json").write_text(json.dumps(meta, indent=2))
    sizes = {p.name: p.stat().st_size for p in out.iterdir()}
    log(f"wrote {out}: {sizes}; {meta}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=["train", "export"])
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=4321)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=100_000, help="upper bound on optimizer steps")
    ap.add_argument("--schedule", choices=["wsd", "cosine"], default="wsd")
    ap.add_argument("--decay-frac", type=float, default=0.25)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=257, help="tokens per window (inputs are one shorter)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--ce-weight", type=float, default=0.1)
    ap.add_argument("--max-minutes", type=float, default=40.0)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--ckpt-every", type=int, default=50)
    args = ap.parse_args()
    if args.cmd == "train":
        cmd_train(args)
    else:
        cmd_export(args)


if __name__ == "__main__":
    sys.exit(main())
