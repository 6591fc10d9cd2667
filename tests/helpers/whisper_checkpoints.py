"""Random-weight Whisper checkpoints (``save_pretrained``) with a tiny Whisper-style tokenizer.

The tokenizer is a byte-level BPE trained on a few sentences, followed by Whisper's special tokens
(``<|endoftext|>``, ``<|startoftranscript|>``, ``<|en|>``, ``<|translate|>``, ``<|transcribe|>``,
``<|startofprev|>``, ``<|nospeech|>``, ``<|notimestamps|>``), so a string prompt made of them
tokenizes as in Whisper. The model's vocabulary is the tokenizer's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

SPECIALS = [
    "<|endoftext|>",
    "<|startoftranscript|>",
    "<|en|>",
    "<|translate|>",
    "<|transcribe|>",
    "<|startofprev|>",
    "<|nospeech|>",
    "<|notimestamps|>",
]
PROMPT_TEXT = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "one two three four five six seven eight nine ten",
    "a forward pass reads every weight once",
    "hello world, this is a test of speech recognition",
]

TINY = {
    "d_model": 64,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "max_target_positions": 64,
    "init_std": 0.2,
}


def write_tokenizer(directory: Path) -> dict[str, int]:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    eot = SPECIALS[0]
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {"tokenizer_class": "WhisperTokenizer", "bos_token": eot, "eos_token": eot, "pad_token": eot}
        )
    )
    return {s: tok.token_to_id(s) for s in SPECIALS} | {"__vocab__": tok.get_vocab_size()}


def make_whisper_checkpoint(
    directory: Path, num_mel_bins: int = 80, max_source_positions: int = 1500, seed: int = 0, **overrides
) -> Path:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    ids = write_tokenizer(directory)
    eot, sot = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    config = WhisperConfig(
        vocab_size=ids["__vocab__"],
        num_mel_bins=num_mel_bins,
        max_source_positions=max_source_positions,
        decoder_start_token_id=sot,
        eos_token_id=eot,
        pad_token_id=eot,
        bos_token_id=eot,
        **{**TINY, **overrides},
    )
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config).eval()
    model.save_pretrained(directory)
    return directory


def prompt_ids(directory: Path) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    return tok.encode(PROMPT_TEXT).ids


def make_clip(seconds: float, seed: int, rate: int = 16_000) -> np.ndarray:
    """A reproducible non-speech clip: a few gliding tones with noise (different per seed)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    out = np.zeros_like(t)
    for _ in range(3):
        f0, f1 = rng.uniform(100, 3000, 2)
        out += rng.uniform(0.1, 0.3) * np.sin(2 * np.pi * (f0 + (f1 - f0) * t / max(seconds, 1e-3) / 2) * t)
    return (out + 0.02 * rng.standard_normal(t.shape)).astype(np.float32)


@torch.no_grad()
def hf_greedy(model, features: torch.Tensor, prompt: list[int], max_new: int) -> list[int]:
    """transformers' greedy tokens for one clip's features ``[mels, frames]`` (no EOS stop: fixed length)."""
    enc = model.model.encoder(features[None]).last_hidden_state
    out = model(encoder_outputs=(enc,), decoder_input_ids=torch.tensor([prompt]), use_cache=True)
    tokens = []
    for _ in range(max_new):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(
            encoder_outputs=(enc,),
            decoder_input_ids=torch.tensor([[tokens[-1]]]),
            past_key_values=out.past_key_values,
            use_cache=True,
        )
    return tokens
