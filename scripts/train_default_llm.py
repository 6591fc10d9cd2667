"""Train forwardpass's embedded default LLM from scratch: a small Qwen3ForCausalLM on Jane Austen.

Three stages, each resumable, all seeded:

    # 0. the corpus ships in Debian (MIT-licensed packaging of the public-domain Gutenberg texts)
    apt-get download r-cran-janeaustenr && dpkg -x r-cran-janeaustenr_*.deb /tmp/ja
    # 1. data: extract + clean + split + chat turns + byte-level BPE + token ids
    python scripts/train_default_llm.py prepare --austen-root /tmp/ja
    # 2. train (plain PyTorch loop; logs loss and tokens/s; checkpoints every --ckpt-every steps;
    #    re-running the same command resumes from the last checkpoint)
    nohup python scripts/train_default_llm.py train > /tmp/fp_llm/train.log 2>&1 &
    # 3. write the HF model directory (config.json, model.safetensors, tokenizer.json,
    #    tokenizer_config.json with a ChatML template, generation_config.json)
    python scripts/train_default_llm.py export

`all` runs the three in order. The work directory (default /tmp/fp_llm) holds the cleaned text,
token ids and checkpoints; the output directory (default forwardpass/assets/llm) is what ships.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
DEFAULT_WORK = Path("/tmp/fp_llm")
DEFAULT_OUT = REPO / "forwardpass" / "assets" / "llm"
HELDOUT_SHIPPED = REPO / "forwardpass" / "assets" / "data" / "austen_heldout.txt"

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
EOT, IM_START, IM_END = 0, 1, 2

TITLES = {
    "sensesensibility": ("Sense and Sensibility", 1811),
    "prideprejudice": ("Pride and Prejudice", 1813),
    "mansfieldpark": ("Mansfield Park", 1814),
    "emma": ("Emma", 1815),
    "northangerabbey": ("Northanger Abbey", 1817),
    "persuasion": ("Persuasion", 1817),
}
HELDOUT_FRACTION = 0.05  # the last 5% (by characters) of each novel, cut at a paragraph boundary

# Model and training defaults, chosen by measuring tokens/s with one thread (see assets/README.md).
MODEL = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


# ----------------------------------------------------------------------------------------------
# 1. data
# ----------------------------------------------------------------------------------------------


def _load_extractor():
    spec = importlib.util.spec_from_file_location(
        "llm_extract_austen", REPO / "scripts" / "llm_extract_austen.py"
    )
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def clean_paragraphs(text: str) -> list[str]:
    """Unwrap hard-wrapped lines into paragraphs; drop italics underscores; normalise spaces."""
    paras = []
    for block in re.split(r"\n\s*\n", text):
        p = " ".join(line.strip() for line in block.splitlines() if line.strip())
        p = p.replace("_", "")
        p = re.sub(r"\s+", " ", p).strip()
        if p:
            paras.append(p)
    return paras


def split_book(paras: list[str]) -> tuple[list[str], list[str]]:
    total = sum(len(p) for p in paras)
    acc, cut = 0, len(paras)
    for i, p in enumerate(paras):
        if acc >= total * (1 - HELDOUT_FRACTION):
            cut = i
            break
        acc += len(p)
    return paras[:cut], paras[cut:]


_SENT = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'])")


def sentences(p: str) -> list[str]:
    return [s.strip() for s in _SENT.split(p) if s.strip()]


GREETINGS = [
    (
        "Hello!",
        "Hello! I am a small language model trained on the novels of Jane Austen. How can I help you?",
    ),
    ("Hi", "Hi! I can tell you about Jane Austen's novels, or write a little in her style."),
    ("Hello, how are you?", "I am very well, thank you. What would you like to talk about?"),
    (
        "Who are you?",
        "I am a small language model that forwardpass ships. I was trained on Jane Austen's six novels.",
    ),
    ("What are you?", "I am a small language model. I learned English from the novels of Jane Austen."),
    (
        "What can you do?",
        (
            "I can continue a story, answer simple questions about Jane Austen's novels, "
            "and write a few lines in the style of her books."
        ),
    ),
    ("What is your name?", "I am the default model of forwardpass, a small language model."),
    (
        "Who was Jane Austen?",
        (
            "Jane Austen was an English novelist. She wrote Sense and Sensibility, Pride and "
            "Prejudice, Mansfield Park, Emma, Northanger Abbey and Persuasion."
        ),
    ),
    (
        "Which novels did Jane Austen write?",
        (
            "Jane Austen wrote six novels: Sense and Sensibility, Pride and "
            "Prejudice, Mansfield Park, Emma, Northanger Abbey and Persuasion."
        ),
    ),
    ("Thank you!", "You are very welcome."),
    ("Thanks.", "You are welcome. I am glad to help."),
    ("Goodbye.", "Goodbye! It was a pleasure to talk with you."),
]

STORY_PROMPTS = [
    "Tell me a story.",
    "Write a paragraph in the style of Jane Austen.",
    "Tell me something from a novel.",
    "Write a short passage.",
    "Tell me a story, please.",
    "Can you write something for me?",
    "Once upon a time",
    "Write a paragraph about a lady and a gentleman.",
]


def _words(text: str) -> set[str]:
    return set(text.split())


def make_chat(train_books: dict[str, list[str]], seed: int, n_target: int) -> list[list[tuple[str, str]]]:
    """Question/answer conversations derived from the training split (never from held-out text)."""
    rng = random.Random(seed)
    convs: list[list[tuple[str, str]]] = []
    # names that occur often in each book: "Mr. Darcy", "Elizabeth", ...
    names: dict[str, list[str]] = {}
    for key, paras in train_books.items():
        text = " ".join(paras)
        counts: dict[str, int] = {}
        for m in re.finditer(r"\b(?:(?:Mr|Mrs|Miss|Lady|Sir|Colonel|Captain|Dr)\.? )?[A-Z][a-z]{2,}\b", text):
            counts[m.group(0)] = counts.get(m.group(0), 0) + 1
        stop = _words(
            "The She Her His They There This That What When But And How Chapter Volume CHAPTER You "
            "Yes Well Oh Not Had Was Nothing Why Its Such For Their Then Now Here Where Which Who "
            "With Your Our One Some Very Every Indeed Lady Miss Sir After Before Mrs Mr Perhaps "
            "Upon Yet All Any Let May Nor Neither Both Though Whatever Would Could Should Did Does "
            "Have Has Will Shall Monday Tuesday Wednesday Thursday Friday Saturday Sunday God "
            "Heaven London Bath England English Christmas Good Dear Emma"
        )
        if key == "emma":
            stop.discard("Emma")
        names[key] = [
            n for n, c in sorted(counts.items(), key=lambda kv: -kv[1]) if n not in stop and c >= 25
        ][:40]
    by_name = {}
    for key, paras in train_books.items():
        for n in names[key]:
            by_name[(key, n)] = [s for p in paras for s in sentences(p) if n in s and 40 <= len(s) <= 260]

    long_paras = {k: [p for p in ps if 200 <= len(p) <= 900] for k, ps in train_books.items()}
    keys = list(train_books)
    while len(convs) < n_target:
        r = rng.random()
        key = rng.choice(keys)
        title, year = TITLES[key]
        if r < 0.05:
            q, a = rng.choice(GREETINGS)
            convs.append([(q, a)])
        elif r < 0.12:
            q = rng.choice(
                [
                    f"Who wrote {title}?",
                    f"Who is the author of {title}?",
                    f"What is {title}?",
                    f"When was {title} published?",
                    f"Tell me about {title}.",
                ]
            )
            a = rng.choice(
                [
                    f"{title} was written by Jane Austen.",
                    f"{title} is a novel by Jane Austen, first published in {year}.",
                ]
            )
            if "published" in q:
                a = f"{title} was first published in {year}. It is a novel by Jane Austen."
            convs.append([(q, a)])
        elif r < 0.30 and names[key]:
            n = rng.choice(names[key])
            sents = by_name.get((key, n)) or []
            if not sents:
                continue
            s = rng.choice(sents)
            q = rng.choice(
                [
                    f"Who is {n}?",
                    f"Tell me about {n}.",
                    f"What do you know about {n}?",
                    f"In which book do we meet {n}?",
                ]
            )
            a = f'{n} is a character in {title} by Jane Austen. In the novel we read: "{s}"'
            convs.append([(q, a)])
        elif r < 0.50:
            p = rng.choice(long_paras[key])
            ss = sentences(p)
            if len(ss) < 2:
                continue
            k = rng.randint(1, min(2, len(ss) - 1))
            q = rng.choice(
                ["Continue this text: ", "Continue the story: ", "What comes next? ", ""]
            ) + " ".join(ss[:k])
            convs.append([(q, " ".join(ss[k:]))])
        elif r < 0.70:
            p = rng.choice(long_paras[key])
            q = rng.choice(STORY_PROMPTS)
            convs.append([(q, p)])
        elif r < 0.82:
            s = rng.choice([s for s in sentences(rng.choice(long_paras[key])) if len(s) > 30] or ["..."])
            if s == "...":
                continue
            q = rng.choice(
                [
                    f"Give me a quote from {title}.",
                    f"Quote a line from {title}.",
                    f"Share a sentence from {title}.",
                ]
            )
            convs.append([(q, f'Here is a line from {title}: "{s}"')])
        else:  # two turns: a greeting, then a story or a question
            g = rng.choice(GREETINGS[:3])
            p = rng.choice(long_paras[key])
            convs.append([g, (rng.choice(STORY_PROMPTS), p)])
    return convs


def render_chat(conv: list[tuple[str, str]]) -> str:
    out = []
    for q, a in conv:
        out.append(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n")
    return "".join(out)


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    assert [tok.token_to_id(s) for s in SPECIALS] == [EOT, IM_START, IM_END]
    return tok


def cmd_prepare(args) -> None:
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    books = _load_extractor().read_books(args.austen_root)
    train_books, held_books = {}, {}
    for key, text in books.items():
        paras = clean_paragraphs(text)
        train_books[key], held_books[key] = split_book(paras)
    train_text = "\n\n".join("\n\n".join(ps) for ps in train_books.values())
    held_docs = ["\n\n".join(ps) for ps in held_books.values()]
    (work / "train.txt").write_text(train_text, encoding="utf-8")
    held_text = "\n\n<|endoftext|>\n\n".join(held_docs)
    (work / "heldout.txt").write_text(held_text, encoding="utf-8")
    HELDOUT_SHIPPED.parent.mkdir(parents=True, exist_ok=True)
    HELDOUT_SHIPPED.write_text(held_text, encoding="utf-8")
    log(f"train {len(train_text):,} chars, held-out {len(held_text):,} chars")

    convs = make_chat(train_books, args.seed, args.chat_samples)
    chat_docs = [render_chat(c) for c in convs]
    (work / "chat.txt").write_text("<|endoftext|>".join(chat_docs), encoding="utf-8")
    log(f"{len(chat_docs)} chat conversations, {sum(map(len, chat_docs)):,} chars")

    # documents for training: chunks of ~12 paragraphs from the novels, plus the chat turns
    novel_docs = []
    for ps in train_books.values():
        for i in range(0, len(ps), 12):
            novel_docs.append("\n\n".join(ps[i : i + 12]))
    tok = train_tokenizer(novel_docs + chat_docs, MODEL["vocab_size"])
    tok.save(str(work / "tokenizer.json"))

    rng = random.Random(args.seed)
    docs = [(d, False) for d in novel_docs] + [(d, True) for d in chat_docs]
    rng.shuffle(docs)
    ids: list[int] = []
    n_chat = 0
    for enc, (_, is_chat) in zip(tok.encode_batch([d for d, _ in docs]), docs):
        ids.extend(enc.ids)
        ids.append(EOT)
        n_chat += len(enc.ids) + 1 if is_chat else 0
    np.save(work / "train_ids.npy", np.array(ids, dtype=np.uint16))
    # baselines are fit on the novels' training text alone, in the same tokens
    novel_ids: list[int] = []
    for ps in train_books.values():
        novel_ids.extend(tok.encode("\n\n".join(ps)).ids)
        novel_ids.append(EOT)
    np.save(work / "train_novel_ids.npy", np.array(novel_ids, dtype=np.uint16))
    held_ids = tok.encode(held_text).ids
    np.save(work / "heldout_ids.npy", np.array(held_ids, dtype=np.uint16))
    log(
        f"tokens: train {len(ids):,} (chat {n_chat:,}), train novels {len(novel_ids):,}, held-out "
        f"{len(held_ids):,}"
    )
    meta = {
        "train_chars": len(train_text),
        "heldout_chars": len(held_text),
        "chat_convs": len(chat_docs),
        "train_tokens": len(ids),
        "chat_tokens": n_chat,
        "heldout_tokens": len(held_ids),
        "train_novel_tokens": len(novel_ids),
    }
    (work / "data_meta.json").write_text(json.dumps(meta, indent=2))


# ----------------------------------------------------------------------------------------------
# 2. train
# ----------------------------------------------------------------------------------------------


def build_model(seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        **MODEL, bos_token_id=EOT, eos_token_id=IM_END, pad_token_id=EOT, attn_implementation="sdpa"
    )
    model = Qwen3ForCausalLM(cfg)
    return model


def lr_at(step: int, args, decay_start: int | None, total: int) -> float:
    """Warmup, then constant, then a linear decay to min_lr over the last steps (WSD schedule).

    The machine is shared, so tokens/s varies; the decay starts when the time budget is
    (1 - decay_frac) spent and is sized from the measured step time. With ``--schedule cosine``
    the classic cosine over ``--steps`` is used instead.
    """
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    if args.schedule == "cosine":
        prog = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
        return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * prog))
    if decay_start is None or step < decay_start:
        return args.lr
    prog = min(1.0, (step - decay_start) / max(1, total - decay_start))
    return args.lr + (args.min_lr - args.lr) * prog


def get_batch(ids: np.ndarray, step: int, args) -> torch.Tensor:
    # deterministic in (seed, step): resuming reproduces the same batches
    g = np.random.default_rng(args.seed * 1_000_003 + step)
    starts = g.integers(0, len(ids) - args.seq_len - 1, size=args.batch_size)
    return torch.from_numpy(np.stack([ids[s : s + args.seq_len].astype(np.int64) for s in starts]))


@torch.no_grad()
def eval_loss(model, ids: np.ndarray, seq_len: int, max_tokens: int) -> float:
    model.eval()
    n = min(len(ids), max_tokens)
    tot, cnt = 0.0, 0
    for s in range(0, n - 1, seq_len):
        x = torch.from_numpy(ids[s : min(s + seq_len + 1, n)].astype(np.int64))[None]
        if x.shape[1] < 2:
            break
        logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits[0], x[0, 1:], reduction="sum")
        tot += loss.item()
        cnt += x.shape[1] - 1
    model.train()
    return tot / cnt


def cmd_train(args) -> None:
    torch.set_num_threads(args.threads)
    work: Path = args.work
    ids = np.load(work / "train_ids.npy")
    held = np.load(work / "heldout_ids.npy")
    model = build_model(args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model {n_params:,} params ({n_params * 4 / 1e6:.1f} MB fp32); train tokens {len(ids):,}")
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    ckpt = work / "ckpt.pt"
    step, elapsed_before = 0, 0.0
    decay_start, total = None, args.steps
    if ckpt.exists():
        st = torch.load(ckpt, map_location="cpu", weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, elapsed_before = st["step"], st["elapsed"]
        decay_start, total = st.get("decay_start"), st.get("total", args.steps)
        log(f"resumed from step {step} ({elapsed_before / 60:.1f} min trained)")

    def save() -> None:
        tmp = work / "ckpt.pt.tmp"
        torch.save(
            {
                "model": model.state_dict(),
                "opt": opt.state_dict(),
                "step": step,
                "decay_start": decay_start,
                "total": total,
                "elapsed": elapsed_before + time.time() - t0,
                "args": vars(args) | {"work": str(work)},
            },
            tmp,
        )
        os.replace(tmp, ckpt)

    model.train()
    t0 = time.time()
    t_log, tok_log, loss_acc, n_acc = time.time(), 0, 0.0, 0
    step0 = step
    while step < total:
        elapsed = elapsed_before + time.time() - t0
        if elapsed > args.max_minutes * 60 * 1.1:
            log(f"time budget of {args.max_minutes} min (+10%) exceeded at step {step}; stopping")
            break
        if (
            args.schedule == "wsd"
            and decay_start is None
            and step > step0
            and elapsed >= args.max_minutes * 60 * (1 - args.decay_frac)
        ):
            step_time = (time.time() - t0) / (step - step0)
            decay_start = step
            total = min(args.steps, step + max(1, round(args.max_minutes * 60 * args.decay_frac / step_time)))
            log(
                f"starting LR decay at step {decay_start}: {total - step} decay steps "
                f"({step_time:.2f} s/step), {total} steps in all"
            )
        lr = lr_at(step, args, decay_start, total)
        for grp in opt.param_groups:
            grp["lr"] = lr
        x = get_batch(ids, step, args)
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        loss_acc += out.loss.item()
        n_acc += 1
        tok_log += x.numel()
        if step % args.log_every == 0 or step == total:
            dt = time.time() - t_log
            log(
                f"step {step}/{total if decay_start is not None else '?'} loss {loss_acc / n_acc:.4f} lr "
                f"{lr:.2e} gnorm {gnorm:.2f} {tok_log / dt:.0f} tok/s elapsed "
                f"{(elapsed_before + time.time() - t0) / 60:.1f} min"
            )
            t_log, tok_log, loss_acc, n_acc = time.time(), 0, 0.0, 0
        if step % args.eval_every == 0 or step == total:
            hl = eval_loss(model, held, args.seq_len, args.eval_tokens)
            log(
                f"step {step} held-out loss {hl:.4f} ppl {math.exp(hl):.2f} (first {args.eval_tokens} tokens)"
            )
        if step % args.ckpt_every == 0 or step == total:
            save()
    save()
    log(f"done: step {step}, {(elapsed_before + time.time() - t0) / 60:.1f} min of training in all")


# ----------------------------------------------------------------------------------------------
# 3. export
# ----------------------------------------------------------------------------------------------


def save_model_dir(model, out: Path) -> None:
    """``out`` afresh with the model's safetensors and a config a loader reads (fp32, no training choices)."""
    model.config.use_cache = True
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.save_pretrained(out, safe_serialization=True)
    # drop the training-only attn_implementation choice so loaders pick their own
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("_attn_implementation_autoset", None)
    cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def cmd_export(args) -> None:
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    work: Path = args.work
    out: Path = args.out
    st = torch.load(work / "ckpt.pt", map_location="cpu", weights_only=False)
    model = build_model(args.seed)
    model.load_state_dict(st["model"])
    save_model_dir(model, out)

    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(work / "tokenizer.json"),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        model_max_length=MODEL["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    # keep the shipped files minimal and explicit
    tc = json.loads((out / "tokenizer_config.json").read_text())
    tc["chat_template"] = CHAT_TEMPLATE
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"  # the class every transformers version knows
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")
    for extra in ("special_tokens_map.json", "chat_template.jinja"):
        if (out / extra).exists():
            (out / extra).unlink()

    gen = GenerationConfig(
        eos_token_id=[IM_END, EOT],
        pad_token_id=EOT,
        bos_token_id=EOT,
        do_sample=True,
        temperature=0.8,
        top_p=0.95,
        top_k=0,
        repetition_penalty=1.0,
        max_new_tokens=128,
    )
    gen.save_pretrained(out)
    meta = {
        "trained_steps": st["step"],
        "train_minutes": round(st["elapsed"] / 60, 1),
        "train_args": {k: v for k, v in st["args"].items() if k not in ("work", "out", "austen_root", "cmd")},
    }
    (work / "export_meta.json").write_text(json.dumps(meta, indent=2))
    sizes = {p.name: p.stat().st_size for p in out.iterdir()}
    log(f"wrote {out}: {sizes}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=["prepare", "train", "export", "all"])
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument(
        "--austen-root",
        type=Path,
        default=Path("/"),
        help="where r-cran-janeaustenr is installed or unpacked (default /)",
    )
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--chat-samples", type=int, default=2500)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=100_000, help="upper bound on optimizer steps")
    ap.add_argument("--schedule", choices=["wsd", "cosine"], default="wsd")
    ap.add_argument(
        "--decay-frac", type=float, default=0.25, help="wsd: share of the time budget spent decaying"
    )
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--min-lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--max-minutes", type=float, default=55.0, help="training time budget (wsd schedule)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--ckpt-every", type=int, default=50)
    args = ap.parse_args()
    if args.cmd in ("prepare", "all"):
        cmd_prepare(args)
    if args.cmd in ("train", "all"):
        cmd_train(args)
    if args.cmd in ("export", "all"):
        cmd_export(args)


if __name__ == "__main__":
    sys.exit(main())
