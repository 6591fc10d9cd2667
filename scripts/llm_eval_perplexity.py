"""Held-out perplexity of the embedded default LLM next to unigram and bigram baselines.

    apt-get download r-cran-janeaustenr && dpkg -x r-cran-janeaustenr_*.deb /tmp/ja
    python scripts/llm_eval_perplexity.py --austen-root /tmp/ja

All three are scored on the same tokens: the shipped held-out text
(``forwardpass/assets/data/austen_heldout.txt``, the last 5% of each novel) encoded with the shipped
tokenizer. The baselines are fit on the training split of the novels, rebuilt from the Debian package
exactly as ``scripts/train_default_llm.py prepare`` builds it (without ``--austen-root`` only the model
is scored). The model is scored with a sliding window of ``--window`` tokens (its training length) and
stride ``--stride``: every token after the first is predicted once, with at least window - stride
tokens of context (except in the first window).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # the repo's forwardpass, also when run as a file

import argparse
import importlib.util
import itertools
import json
import math
import time
from collections import Counter
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _train_script():
    spec = importlib.util.spec_from_file_location(
        "train_default_llm", REPO / "scripts" / "train_default_llm.py"
    )
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


@torch.no_grad()
def model_nll(model, ids: list[int], window: int, stride: int) -> tuple[float, int]:
    """Summed negative log-likelihood (nats) of ids[1:], and the number of tokens scored."""
    total, count, scored_to = 0.0, 0, 1
    n = len(ids)
    for begin in range(0, n - 1, stride):
        end = min(begin + window, n)
        if end <= scored_to:
            continue
        x = torch.tensor(ids[begin:end])[None]
        logp = torch.log_softmax(
            model(input_ids=x).logits[0].float(), dim=-1
        )  # predicts ids[begin+1 : end+1]
        tgt = torch.arange(scored_to, end)
        total -= logp[tgt - begin - 1, x[0, tgt - begin]].sum().item()
        count += len(tgt)
        scored_to = end
        if end == n:
            break
    return total, count


def unigram_nll(train: list[int], test: list[int], vocab: int, k: float = 1.0) -> float:
    c = Counter(train)
    denom = len(train) + k * vocab
    return -sum(math.log((c[w] + k) / denom) for w in test[1:])


def bigram_kn_nll(train: list[int], test: list[int], vocab: int, d: float = 0.75) -> float:
    """Interpolated Kneser-Ney bigram (absolute discount d); continuation counts add-one smoothed."""
    big = Counter(itertools.pairwise(train))
    ctx = Counter(train[:-1])
    followers = Counter(v for v, _ in big)  # N1+(v .)
    cont = Counter(w for _, w in big)  # N1+(. w)
    n_types = len(big)

    def p_cont(w: int) -> float:
        return (cont[w] + 1) / (n_types + vocab)

    nll = 0.0
    for v, w in itertools.pairwise(test):
        cv = ctx[v]
        if cv == 0:
            p = p_cont(w)
        else:
            p = max(big[(v, w)] - d, 0) / cv + d * followers[v] / cv * p_cont(w)
        nll -= math.log(p)
    return nll


def main() -> None:
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from forwardpass.assets import default_llm_heldout_text_path, default_llm_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=default_llm_path())
    ap.add_argument("--heldout", type=Path, default=default_llm_heldout_text_path())
    ap.add_argument(
        "--austen-root", type=Path, default=None, help="unpacked r-cran-janeaustenr (for baselines)"
    )
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--stride", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=None, help="score only the first N held-out tokens")
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = ap.parse_args()
    torch.set_num_threads(1)

    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    held_text = args.heldout.read_text(encoding="utf-8")
    held = tok.encode(held_text).ids
    if args.max_tokens:
        held = held[: args.max_tokens]
        held_text = tok.decode(held, skip_special_tokens=False)
    n_bytes = len(held_text.encode("utf-8"))

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    t0 = time.time()
    nll, n = model_nll(model, held, args.window, args.stride)
    rows = [
        (
            "forwardpass default LLM (Qwen3, %.1fM params)"
            % (sum(p.numel() for p in model.parameters()) / 1e6),
            nll,
        )
    ]
    print(f"model scored {n:,} tokens in {time.time() - t0:.1f}s")

    if args.austen_root is not None:
        ts = _train_script()
        books = ts._load_extractor().read_books(args.austen_root)
        train: list[int] = []
        for text in books.values():
            train_paras, _ = ts.split_book(ts.clean_paragraphs(text))
            train.extend(tok.encode("\n\n".join(train_paras)).ids)
            train.append(ts.EOT)
        print(f"baselines fit on {len(train):,} training tokens")
        rows.append(("unigram, add-one", unigram_nll(train, held, vocab)))
        rows.append(("bigram, interpolated Kneser-Ney (d=0.75)", bigram_kn_nll(train, held, vocab)))

    print(f"\nHeld-out: {args.heldout.name}, {n:,} tokens scored ({n_bytes:,} bytes), vocabulary {vocab}\n")
    print("| model | loss (nats/token) | perplexity | bits/byte |")
    print("|---|---:|---:|---:|")
    out = {}
    for name, total in rows:
        loss = total / n
        bpb = total / math.log(2) / n_bytes
        print(f"| {name} | {loss:.3f} | {math.exp(loss):.2f} | {bpb:.3f} |")
        out[name] = {"loss": loss, "perplexity": math.exp(loss), "bits_per_byte": bpb}
    if args.json:
        args.json.write_text(json.dumps({"tokens": n, "bytes": n_bytes, "rows": out}, indent=2))


if __name__ == "__main__":
    main()
