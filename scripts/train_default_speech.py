"""Train forwardpass's embedded default speech model: a tiny WhisperForConditionalGeneration on espeak-ng.

Speech is synthesised here with Debian's ``espeak-ng`` (``apt-get install espeak-ng``): random
utterances of one to four items, each a common English word or a number (0–999, written as digits in
the transcript), spoken by several espeak voices and variants at several speeds, with random gain,
leading silence and light Gaussian noise (20–40 dB SNR, drawn fresh every time a clip is used).
A second training file (``train_extra.pt``) adds more accents, more espeak-ng variants and a random pitch.
Held-out utterances use voices, variants and speeds the model never heard.
Training adds speed perturbation and SpecAugment-style masks, and a training-only CTC loss on the encoder
(espeak-ng's phonemes of the transcript) that makes the encoder learn the sounds early; it is not exported.

    python scripts/train_default_speech.py all            # data → train → export → evaluate
    python scripts/train_default_speech.py data|train|export|eval

The model reads 3 s of audio (``max_source_positions`` 150 → 300 log-mel frames, not Whisper's 30 s):
a legitimate Whisper config that transformers runs, ten times cheaper to train and to run. The work
directory (default /tmp/fp_speech) holds the synthesised clips and checkpoints; the output directory
(default forwardpass/assets/speech) is what ships: config.json, model.safetensors (fp16),
generation_config.json, tokenizer.json, tokenizer_config.json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from forwardpass.audio import log_mel_spectrogram, read_wav, to_mono_16k
from forwardpass.transcription import word_errors

DEFAULT_WORK = Path("/tmp/fp_speech")
DEFAULT_OUT = REPO / "forwardpass" / "assets" / "speech"

# a few hundred common English words (the digits and numbers 0-999 come on top, see utterance())
_WORD_LIST = """
a about after again air all also always an and animal answer any are around as ask at away back be
because been before begin best big bird black blue boat body book both box boy bring brother brown build
but buy by call came can car care carry cat change child city close cold color come could country cut day
did different do does dog done door down draw dream drink drive each early earth eat eight end enough
even evening every eye face fall family far farm fast father feel few field fight find fine fire first
fish five floor fly follow food foot for four free friend from full game gave get girl give glass go gold
good great green ground group grow had half hand happy hard has have he head hear heart help her here
high hill him his hold home horse hot house how hundred idea if in into is it just keep kind king know
land large last late laugh learn leave left let letter life light like line list listen little live long
look love low made make man many may me mean men might mile milk mind minute money month moon more
morning most mother mountain move much music must my name near need never new next nice night nine no
north not nothing now number of off often old on once one only open or other our out over page paper part
people picture place plant play point pull put question quick quiet rain read ready red right river road
rock room run said same saw say school sea second see seven she ship short should show side simple sing
sister sit six sleep slow small snow so some song soon sound south speak spring stand star start stay
still stone stop story street strong study such summer sun table take talk tea ten than thank that the
their them then there these they thing think this three through time to today together too took town tree
true try turn two under until up us use very voice walk want warm was watch water way we week well went
were west what when where which while white who why will wind window winter with without woman wood word
work world write year yellow yes you young your zero
"""
WORDS = _WORD_LIST.split()

SOT, LANG, TASK, NO_TS = "<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>"
SPECIALS = ["<|endoftext|>", SOT, LANG, "<|translate|>", TASK, "<|startofprev|>", "<|nospeech|>", NO_TS]
PROMPT = [SOT, LANG, TASK, NO_TS]

TRAIN_VOICES = [
    f"{lang}+{var}"
    for lang in ("en-us", "en", "en-gb-x-rp")
    for var in ("m1", "m2", "m3", "m4", "f1", "f2", "f4", "f5")
]
TRAIN_SPEEDS = (135, 150, 165, 180, 195)
HELDOUT_VOICES = ("en-gb-scotland+m6", "en-029+f3", "en-gb-x-gbclan+m7", "en-us+klatt")
HELDOUT_SPEEDS = (143, 172, 188)
# the "extra" training split: more accents, more espeak-ng variants and a random pitch (-p 20-80, default 50).
# None of the held-out voices or variants: no en-gb-scotland, en-029 or en-gb-x-gbclan, no m6/f3/m7 and no
# Klatt-synthesiser variant at all (klatt, klatt2-6 and the variants built on it are left out).
EXTRA_VOICES = [
    f"{lang}+{var}"
    for lang in ("en-us", "en", "en-gb-x-rp", "en-us-nyc", "en-gb-x-gbcwmd")
    for var in (
        "m1", "m2", "m3", "m4", "m5", "m8", "f1", "f2", "f4", "f5", "Alex", "Andy", "Annie", "aunty",
        "belinda", "boris", "ed", "iven", "john", "linda", "max", "michel", "norbert", "steph", "travis",
        "zac", "grandma", "grandpa", "Mike", "quincy", "rob", "robert", "paul", "shelby", "victor", "Lee",
    )
]  # fmt: skip
EXTRA_PITCHES = tuple(range(20, 81, 5))

SAMPLE_RATE = 16_000
MAX_SOURCE_POSITIONS = 150  # 3 s of audio: 300 log-mel frames, conv stride 2 → 150 encoder positions
NUM_FRAMES = 2 * MAX_SOURCE_POSITIONS
MODEL = {
    "num_mel_bins": 80,
    "d_model": 192,
    "encoder_layers": 3,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 768,
    "decoder_ffn_dim": 768,
    "max_source_positions": MAX_SOURCE_POSITIONS,
    "max_target_positions": 64,
    "dropout": 0.0,
    "activation_function": "gelu",
    "scale_embedding": False,
}
BPE_VOCAB = 700  # byte-level BPE: enough merges that almost every word and number is one or two tokens


def utterance(rng: random.Random) -> str:
    items = []
    for _ in range(rng.choice((1, 2, 2, 3, 3, 4))):
        r = rng.random()
        if r < 0.65:
            items.append(rng.choice(WORDS))
        elif r < 0.8:
            items.append(str(rng.randrange(10)))
        elif r < 0.93:
            items.append(str(rng.randrange(10, 100)))
        else:
            items.append(str(rng.randrange(100, 1000)))
    return " ".join(items)


def synthesise(text: str, voice: str, speed: int, pitch: int | None = None) -> np.ndarray:
    with tempfile.NamedTemporaryFile(suffix=".wav") as f:
        extra = [] if pitch is None else ["-p", str(pitch)]
        subprocess.run(
            ["espeak-ng", "-v", voice, "-s", str(speed), *extra, "-w", f.name, text],
            check=True,
            capture_output=True,
        )
        samples, rate = read_wav(f.name)
    return to_mono_16k(samples, rate)


def fits(clip: np.ndarray) -> bool:
    return len(clip) <= NUM_FRAMES * 160 - 4800  # the window, with room for 0.3 s of lead-in silence


def make_split(n: int, voices, speeds, seed: int, pitches=None) -> tuple[list[str], list[np.ndarray]]:
    rng = random.Random(seed)
    jobs = [
        (utterance(rng), rng.choice(voices), rng.choice(speeds), rng.choice(pitches) if pitches else None)
        for _ in range(n)
    ]
    with ThreadPoolExecutor(4) as pool:  # espeak-ng runs as a subprocess: threads overlap its start-up
        audio = list(pool.map(lambda j: synthesise(*j), jobs))
    keep = [i for i, a in enumerate(audio) if fits(a)]
    return [jobs[i][0] for i in keep], [audio[i].astype(np.float16) for i in keep]


def load_split(work: Path, name: str) -> tuple[list[str], list[np.ndarray]]:
    files = [work / f"{name}.pt"]
    if name == "train" and (work / "train_extra.pt").exists():  # train on both training files
        files.append(work / "train_extra.pt")
    texts: list[str] = []
    audio: list[np.ndarray] = []
    for path in files:
        data = torch.load(path, weights_only=False)
        keep = [i for i, a in enumerate(data["audio"]) if fits(a)]
        texts += [data["texts"][i] for i in keep]
        audio += [data["audio"][i] for i in keep]
    return texts, audio


def cmd_data(args) -> None:
    args.work.mkdir(parents=True, exist_ok=True)
    for name, n, voices, speeds, seed, pitches in (
        ("train", args.train_clips, TRAIN_VOICES, TRAIN_SPEEDS, 1, None),
        ("heldout", args.heldout_clips, HELDOUT_VOICES, HELDOUT_SPEEDS, 2, None),
        ("train_extra", args.extra_clips, EXTRA_VOICES, TRAIN_SPEEDS, 4, EXTRA_PITCHES),
    ):
        if name not in args.splits.split(",") or n <= 0:
            continue
        t0 = time.time()
        texts, audio = make_split(n, voices, speeds, seed, pitches)
        torch.save({"texts": texts, "audio": audio}, args.work / f"{name}.pt")
        print(
            f"{name}: {len(texts)} clips, {sum(map(len, audio)) / SAMPLE_RATE / 3600:.2f} h, "
            f"{time.time() - t0:.0f} s",
            flush=True,
        )


def build_tokenizer(texts: list[str]):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([" " + t for t in texts], trainer)  # Whisper's text starts with a space
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok


def phonemes(texts: list[str]) -> list[list[str]]:
    """espeak-ng's own phonemes of each transcript (``-x``, stress marks dropped, ``|`` between words):
    the targets of the training-only CTC loss; numbers come out as the words espeak says."""
    out = subprocess.run(
        ["espeak-ng", "-q", "-x", "--sep=_", "-v", "en-us"],
        input="".join(t + ".\n" for t in texts),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = [line for line in out.split("\n") if line.strip()]
    if len(lines) != len(texts):
        raise RuntimeError(f"espeak-ng gave {len(lines)} phoneme lines for {len(texts)} transcripts")
    result = []
    for line in lines:
        units: list[str] = []
        for word in line.split():
            units += [p for p in word.replace("'", "").replace(",", "").split("_") if p] + ["|"]
        result.append(units[:-1])
    return result


def augment(clip: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    x = clip.astype(np.float32) * rng.uniform(0.3, 1.0)
    # speed perturbation (tempo and pitch together, as in Kaldi's 0.9/1.0/1.1): other voices, other rates
    factor = rng.uniform(0.85, 1.15)
    factor = min(factor, (NUM_FRAMES * 160 - 4800) / max(len(x), 1))  # stay inside the window
    n = max(int(len(x) * factor), 1)
    x = np.interp(np.arange(n) / factor, np.arange(len(x)), x).astype(np.float32)
    x = np.concatenate([np.zeros(int(rng.uniform(0, 0.3) * SAMPLE_RATE), np.float32), x])
    power = float(np.mean(x**2)) + 1e-8
    snr_db = rng.uniform(20, 40)
    return x + rng.standard_normal(x.shape).astype(np.float32) * math.sqrt(power / 10 ** (snr_db / 10))


def features(clips: list[np.ndarray], rng: np.random.Generator | None) -> torch.Tensor:
    feats = torch.stack(
        [
            log_mel_spectrogram(
                augment(c, rng) if rng is not None else c.astype(np.float32),
                MODEL["num_mel_bins"],
                NUM_FRAMES,
            )
            for c in clips
        ]
    )
    if rng is not None:  # SpecAugment-style masking: one frequency band and one short time span per clip
        for f in feats:
            width = int(rng.integers(0, 11))
            start = int(rng.integers(0, f.shape[0] - width + 1))
            f[start : start + width] = f.mean()
            width = int(rng.integers(0, 16))
            start = int(rng.integers(0, f.shape[1] - width + 1))
            f[:, start : start + width] = f.mean()
    return feats


def make_model(tok):
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    config = WhisperConfig(
        vocab_size=tok.get_vocab_size(),
        **MODEL,
        decoder_start_token_id=ids[SOT],
        pad_token_id=ids["<|endoftext|>"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|endoftext|>"],
        suppress_tokens=[],
        begin_suppress_tokens=[],
    )
    return WhisperForConditionalGeneration(config)


def encode_targets(tok, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoder inputs (prompt + text) and labels (next token; -100 on the prompt and the padding)."""
    prompt = [tok.token_to_id(s) for s in PROMPT]
    eot = tok.token_to_id("<|endoftext|>")
    seqs = [prompt + tok.encode(" " + t).ids + [eot] for t in texts]
    width = max(map(len, seqs)) - 1
    inputs = torch.full((len(seqs), width), eot)
    labels = torch.full((len(seqs), width), -100)
    for i, s in enumerate(seqs):
        inputs[i, : len(s) - 1] = torch.tensor(s[:-1])
        labels[i, len(prompt) - 1 : len(s) - 1] = torch.tensor(s[len(prompt) :])
    return inputs, labels


@torch.no_grad()
def greedy(model, tok, feats: torch.Tensor, max_new: int = 24) -> list[str]:
    prompt = [tok.token_to_id(s) for s in PROMPT]
    eot = tok.token_to_id("<|endoftext|>")
    enc = model.model.encoder(feats).last_hidden_state
    seqs = torch.tensor([prompt] * feats.shape[0])
    done = torch.zeros(feats.shape[0], dtype=torch.bool)
    for _ in range(max_new):  # no KV cache: utterances are short and this runs only for evaluation
        logits = model(encoder_outputs=(enc,), decoder_input_ids=seqs).logits[:, -1]
        nxt = torch.where(done, eot, logits.argmax(-1))
        seqs = torch.cat([seqs, nxt[:, None]], 1)
        done |= nxt == eot
        if done.all():
            break
    out = []
    for row in seqs[:, len(prompt) :].tolist():
        out.append(tok.decode(row[: row.index(eot)] if eot in row else row).strip())
    return out


def wer(model, tok, texts, audio, batch: int = 64) -> tuple[float, list[tuple[str, str]]]:
    model.eval()
    errors, words, pairs = 0, 0, []
    for i in range(0, len(texts), batch):
        hyps = greedy(model, tok, features(audio[i : i + batch], None))
        for ref, hyp in zip(texts[i : i + batch], hyps, strict=True):
            errors += word_errors(ref, hyp)
            words += len(ref.split())
            pairs.append((ref, hyp))
    return errors / max(words, 1), pairs


def cmd_train(args) -> None:
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    texts, audio = load_split(args.work, "train")
    if args.resume:  # continue from the last checkpoint (fresh optimizer, warm-up and cosine schedule)
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(args.work / "tokenizer.json"))
        model = make_model(tok)
        model.load_state_dict(torch.load(args.work / "model.pt"))
    else:
        tok = build_tokenizer(texts + WORDS + [str(i) for i in range(1000)])
        tok.save(str(args.work / "tokenizer.json"))
        model = make_model(tok)
    # training-only CTC head on the encoder (hybrid CTC/attention): it makes the encoder learn the sounds
    # early, before the decoder has learned to listen; it is not exported (the shipped model is plain Whisper)
    phones = phonemes(texts)
    inventory = {p: i for i, p in enumerate(sorted({p for seq in phones for p in seq}))}
    phone_ids = [[inventory[p] for p in seq] for seq in phones]
    blank = len(inventory)
    ctc_head = torch.nn.Linear(MODEL["d_model"], blank + 1)
    if args.resume and (args.work / "ctc_head.pt").exists():
        ctc_head.load_state_dict(torch.load(args.work / "ctc_head.pt"))
    print(
        f"params {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M, vocab {tok.get_vocab_size()}, "
        f"{len(texts)} clips, {len(inventory)} phonemes",
        flush=True,
    )
    params = list(model.parameters()) + list(ctc_head.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    rng = np.random.default_rng(args.seed)
    order: list[int] = []
    t0, step = time.time(), 0
    val = slice(0, 128)  # the first training clips double as a quick progress check (clean audio)
    while step < args.steps and time.time() - t0 < args.minutes * 60:
        if len(order) < args.batch:
            order += rng.permutation(len(texts)).tolist()
        idx, order = order[: args.batch], order[args.batch :]
        # cosine decay over whichever budget runs out first: steps or wall time
        progress = min(1.0, max(step / args.steps, (time.time() - t0) / (args.minutes * 60)))
        lr = args.lr * min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * progress))
        for g in opt.param_groups:
            g["lr"] = lr
        model.train()
        inputs, labels = encode_targets(tok, [texts[i] for i in idx])
        enc = model.model.encoder(features([audio[i] for i in idx], rng)).last_hidden_state
        loss = model(encoder_outputs=(enc,), decoder_input_ids=inputs, labels=labels).loss
        if args.ctc > 0:
            targets = [phone_ids[i] for i in idx]
            ctc = torch.nn.functional.ctc_loss(
                ctc_head(enc).log_softmax(-1).transpose(0, 1),
                torch.tensor([t for seq in targets for t in seq]),
                torch.full((len(idx),), enc.shape[1]),
                torch.tensor([len(seq) for seq in targets]),
                blank=blank,
                zero_infinity=True,
            )
            total = (1 - args.ctc) * loss + args.ctc * ctc
        else:
            ctc, total = torch.zeros(()), loss
        opt.zero_grad()
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 50 == 0:
            print(
                f"step {step} loss {loss.item():.3f} ctc {ctc.item():.3f} lr {lr:.2e} {time.time() - t0:.0f} "
                "s", flush=True,
            )
        if step % 500 == 0:
            err, _ = wer(model, tok, texts[val], audio[val])
            print(f"step {step} train-sample WER {err:.3f}", flush=True)
            torch.save(model.state_dict(), args.work / "model.pt")
            torch.save(ctc_head.state_dict(), args.work / "ctc_head.pt")
    torch.save(model.state_dict(), args.work / "model.pt")
    torch.save(ctc_head.state_dict(), args.work / "ctc_head.pt")
    print(f"trained {step} steps in {time.time() - t0:.0f} s", flush=True)


def cmd_export(args) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(args.work / "tokenizer.json"))
    model = make_model(tok)
    model.load_state_dict(torch.load(args.work / "model.pt"))
    args.out.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(args.out)  # fp16 on disk, run in fp32
    tok.save(str(args.out / "tokenizer.json"))
    eot = "<|endoftext|>"
    (args.out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "WhisperTokenizer",
                "bos_token": eot,
                "eos_token": eot,
                "pad_token": eot,
                "unk_token": eot,
                "model_max_length": MODEL["max_target_positions"],
            },
            indent=2,
        )
        + "\n"
    )
    for f in args.out.iterdir():
        f.chmod(0o644)  # save_pretrained may write owner-only files; the package ships them readable
    print(f"exported to {args.out}")


def cmd_eval(args) -> None:
    from tokenizers import Tokenizer
    from transformers import WhisperForConditionalGeneration

    from forwardpass import LLM, SamplingParams

    tok = Tokenizer.from_file(str(args.out / "tokenizer.json"))
    model = WhisperForConditionalGeneration.from_pretrained(args.out, dtype=torch.float32)
    texts, audio = load_split(args.work, "heldout")
    err, pairs = wer(model, tok, texts, audio)
    exact = sum(r == h for r, h in pairs) / len(pairs)
    print(
        f"transformers greedy: held-out WER {err:.3f} over {len(pairs)} utterances "
        f"({sum(len(r.split()) for r, _ in pairs)} words); exact-match {exact:.3f}"
    )
    for ref, hyp in pairs[:12]:
        print(f"  {ref!r:40} -> {hyp!r}")
    # digit strings only (2-4 digits), held-out voices and speeds: what this small model does best
    rng = random.Random(3)
    jobs = [
        (
            " ".join(str(rng.randrange(10)) for _ in range(rng.randint(2, 4))),
            rng.choice(HELDOUT_VOICES),
            rng.choice(HELDOUT_SPEEDS),
        )
        for _ in range(100)
    ]
    with ThreadPoolExecutor(4) as pool:
        digit_audio = [a.astype(np.float16) for a in pool.map(lambda j: synthesise(*j), jobs)]
    digit_err, digit_pairs = wer(model, tok, [j[0] for j in jobs], digit_audio)
    digit_exact = sum(r == h for r, h in digit_pairs) / len(digit_pairs)
    print(
        f"transformers greedy: digit strings WER {digit_err:.3f} over 100 utterances; exact-match "
        f"{digit_exact:.3f}"
    )
    # the same clips through forwardpass's engine (its own front end, continuous batching)
    llm = LLM(str(args.out), max_num_seqs=32)
    prompt = [tok.token_to_id(s) for s in PROMPT]
    outs = llm.generate(
        [
            {"prompt_token_ids": prompt, "multi_modal_data": {"audio": (a.astype(np.float32), SAMPLE_RATE)}}
            for a in audio
        ],
        SamplingParams(temperature=0.0, max_tokens=24),
        use_tqdm=False,
    )
    hyps = [o.outputs[0].text.strip() for o in outs]
    errors = sum(word_errors(r, h) for r, h in zip(texts, hyps, strict=True))
    same = sum(h == p[1] for h, p in zip(hyps, pairs, strict=True))
    print(
        f"forwardpass engine: held-out WER {errors / sum(len(r.split()) for r in texts):.3f}; "
        f"{same}/{len(hyps)} transcripts identical to transformers'"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=["data", "train", "export", "eval", "all"])
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--train-clips", type=int, default=6000)
    ap.add_argument("--heldout-clips", type=int, default=400)
    ap.add_argument(
        "--extra-clips", type=int, default=6000, help="clips in train_extra.pt (more voices, random pitch)"
    )
    ap.add_argument("--splits", default="train,heldout,train_extra", help="data: which files to synthesise")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--minutes", type=float, default=35.0, help="stop training after this much wall time")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--ctc", type=float, default=0.5, help="weight of the training-only CTC loss on the encoder"
    )
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--resume", action="store_true", help="train: start from the work directory's model.pt")
    args = ap.parse_args()
    for name in ("data", "train", "export", "eval"):
        if args.cmd in (name, "all"):
            globals()[f"cmd_{name}"](args)


if __name__ == "__main__":
    main()
