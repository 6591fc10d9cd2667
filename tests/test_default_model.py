"""The embedded default LLM (forwardpass/assets/llm): it ships, loads, is deterministic, and is good.

The perplexity bound is stated in forwardpass/assets/README.md; the held-out text ships beside the
model (forwardpass/assets/data/austen_heldout.txt), so no package or download is needed here.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from forwardpass.assets import default_llm_heldout_text_path, default_llm_path
from forwardpass.models.model_spec import load_model_spec

MODEL_DIR = default_llm_path()
PROMPT = "Once upon a time"
# Held-out perplexity on the first EVAL_TOKENS tokens of the held-out text (window 256, stride 128).
# The shipped model measures PPL_MEASURED there; the bound is ~5% above it, so a retrained or damaged model
# that does worse fails. On the whole held-out text the bigram baseline scores 95.6 (assets/README.md).
EVAL_TOKENS = 4096
PPL_MEASURED = 61.62  # scripts/llm_eval_perplexity.py --max-tokens 4096
PPL_BOUND = 65.0


def _has_engine() -> bool:
    try:
        import forwardpass.llm  # noqa: F401
    except ImportError:
        return False
    return True


needs_engine = pytest.mark.skipif(not _has_engine(), reason="forwardpass.llm (the engine) cannot be imported")


# ----- the files --------------------------------------------------------------------------------


def test_default_model_directory_is_complete():
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (MODEL_DIR / name).is_file(), f"{name} missing from {MODEL_DIR}"
    assert load_model_spec(MODEL_DIR).architecture == "Qwen3ForCausalLM"
    assert (MODEL_DIR / "model.safetensors").stat().st_size <= 40 * 2**20
    tc = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tc["chat_template"]
    gen = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert set(gen["eos_token_id"]) == {0, 2}  # <|endoftext|>, <|im_end|>
    assert default_llm_heldout_text_path().is_file()


def test_tokenizer_round_trips_and_knows_chat_tokens():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    text = 'Once upon a time, Mr. Darcy said: "I am quite well." 1813 -- cafe\u0301!'
    assert tok.decode(tok.encode(text).ids) == text
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]


# ----- through transformers (the oracle) ---------------------------------------------------------


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(MODEL_DIR)
    return model, tok


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def test_hf_loads_and_greedy_is_deterministic_english(hf):
    model, tok = hf
    ids = tok(PROMPT)["input_ids"]
    a = _hf_greedy(model, ids, 24)
    b = _hf_greedy(model, ids, 24)
    assert a == b
    text = tok.decode(a, skip_special_tokens=True)
    words = text.split()
    assert len(words) >= 8, text
    # recognisably English: mostly alphabetic words, several of the commonest English words
    assert sum(w.strip(".,;:!?\"'-").isalpha() for w in words) >= 0.7 * len(words), text
    common = {"the", "a", "of", "and", "to", "in", "was", "he", "she", "her", "his", "it", "that", "had", "i"}
    assert len({w.lower().strip(".,;:!?\"'-") for w in words} & common) >= 2, text


def heldout_ppl(model, ids: list[int], window: int = 256, stride: int = 128) -> float:
    total, count, scored_to = 0.0, 0, 1
    with torch.no_grad():
        for begin in range(0, len(ids) - 1, stride):
            end = min(begin + window, len(ids))
            if end <= scored_to:
                continue
            x = torch.tensor(ids[begin:end])[None]
            logp = torch.log_softmax(model(input_ids=x).logits[0].float(), dim=-1)
            tgt = torch.arange(scored_to, end)
            total -= logp[tgt - begin - 1, x[0, tgt - begin]].sum().item()
            count += len(tgt)
            scored_to = end
            if end == len(ids):
                break
    return math.exp(total / count)


def test_hf_heldout_perplexity_below_bound(hf):
    model, _ = hf
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    ids = tok.encode(default_llm_heldout_text_path().read_text(encoding="utf-8")).ids[:EVAL_TOKENS]
    assert len(ids) == EVAL_TOKENS
    ppl = heldout_ppl(model, ids)
    assert ppl < PPL_BOUND, f"held-out perplexity {ppl:.2f} is not below the stated bound {PPL_BOUND}"


# ----- through the engine --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm():
    if not _has_engine():
        pytest.skip("forwardpass.llm (the engine) cannot be imported")
    from forwardpass import LLM

    return LLM()  # no model: the embedded default


@needs_engine
def test_engine_uses_default_model_and_greedy_is_deterministic(llm, hf):
    from forwardpass import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=20)
    a = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    b = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids and a.text == b.text
    assert len(a.text.split()) >= 5, a.text
    # the oracle: the same greedy tokens as transformers (until a stop token, if one comes first)
    model, tok = hf
    ref = _hf_greedy(model, tok(PROMPT)["input_ids"], 20)
    assert list(a.token_ids) == ref[: len(a.token_ids)]


@needs_engine
def test_engine_chat_answers_in_turn(llm):
    from forwardpass import SamplingParams

    out = llm.chat(
        [{"role": "user", "content": "Who wrote Pride and Prejudice?"}],
        SamplingParams(temperature=0, max_tokens=40),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop", out.text  # it ends its turn with <|im_end|>
    assert "<|im_start|>" not in out.text and "user" not in out.text.split()[:1]
    assert "Austen" in out.text, out.text


@needs_engine
def _cpu_seconds(pid: int) -> float:
    """The process's CPU time so far (user + system, its waited-for children included), from /proc."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def test_cli_generate_prints_first_token_within_10s():
    """The issue's promise: after the README's first line has built the kernels, `forwardpass generate
    "Once upon a time"` shows text in 10 s. Measured as the command's CPU time up to its first token, which
    other work on a shared machine does not inflate the way it inflates wall time (a kernel
    compile or a training run before the first token would still blow it)."""
    code = "import sys; from forwardpass.cli import main; sys.exit(main(sys.argv[1:]))"
    # the README's first line builds the kernels first (`forwardpass warmup`; cached: a no-op when built)
    subprocess.run([sys.executable, "-c", code, "warmup", "--kernels", "decode"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    proc = subprocess.Popen(
        # a fixed draw that cannot end at once: unseeded, a run could sample the end of text
        # first and printed nothing after the prompt (a CI failure, not a slow first token)
        [sys.executable, "-c", code, "generate", PROMPT, "--max-tokens", "8", "--seed", "0", "--ignore-eos"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    seen = b""
    first = None
    try:
        assert proc.stdout is not None
        while len(seen) <= len(PROMPT):  # the command echoes the prompt, then streams the completion
            chunk = os.read(proc.stdout.fileno(), 64)
            if not chunk:
                break
            seen += chunk
        first = _cpu_seconds(proc.pid)
        rest = proc.stdout.read()
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    seen += rest
    assert len(seen) > len(PROMPT) + 1, seen
    assert first < 10.0, f"first token after {first:.1f} CPU seconds"
