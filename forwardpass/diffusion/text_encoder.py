"""A tiny transformer text encoder (BERT-shaped, pre-LayerNorm) and its word-level tokenizer.

Why our own and not a packaged sentence encoder: all-MiniLM-L6-v2 is ~90 MB in fp32, far above the
few-megabyte budget of the embedded model, and its general-purpose knowledge buys nothing for
captions about ten digits. A 2-layer encoder trained jointly with the denoiser on varied captions
learns the synonyms we care about ("seven", "7", "a thin 7") in a few hundred kilobytes.

Every prompt starts with ``[CLS]``; the empty prompt (the unconditional input for classifier-free
guidance) is therefore a single ``[CLS]`` token, so cross-attention always has a key to attend to.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from forwardpass.attention import attention
from forwardpass.diffusion.modeling import ConfigModule
from forwardpass.errors import MissingFileError, TokenizerError


class EncoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: float, backend: str):
        super().__init__()
        self.heads, self.backend = heads, backend
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, int(dim * mlp_ratio)), nn.GELU(), nn.Linear(int(dim * mlp_ratio), dim)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = attention(q, k, v, causal=False, key_padding_mask=mask, backend=self.backend)
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


class TinyTextEncoder(ConfigModule):
    WEIGHTS_NAME = "model.safetensors"
    DEFAULTS: ClassVar[dict[str, Any]] = {
        "architectures": ["TinyTextEncoder"],
        "vocab_size": 128,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "mlp_ratio": 2.0,
        "max_position_embeddings": 16,
        "pad_token_id": 0,
        "attention_backend": "sdpa",
    }

    def __init__(self, **config):
        super().__init__(**config)
        c = self.config
        self.embed = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.pos = nn.Embedding(c["max_position_embeddings"], c["hidden_size"])
        self.layers = nn.ModuleList(
            EncoderLayer(c["hidden_size"], c["num_attention_heads"], c["mlp_ratio"], c["attention_backend"])
            for _ in range(c["num_hidden_layers"])
        )
        self.norm = nn.LayerNorm(c["hidden_size"])

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[B, L]`` ids and bool mask (True = real token) → hidden states ``[B, L, hidden]``."""
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed(input_ids) + self.pos(pos)[None]
        for layer in self.layers:
            x = layer(x, attention_mask)
        return self.norm(x)


class PromptTokenizer:
    """Wraps a ``tokenizers`` tokenizer.json; pads a batch to its longest prompt,
    truncates at ``max_length``."""

    def __init__(self, tokenizer, max_length: int):
        self.tok = tokenizer
        self.max_length = max_length
        self.pad_id = tokenizer.token_to_id("[PAD]") or 0

    @classmethod
    def from_pretrained(cls, directory: str | Path, max_length: int) -> PromptTokenizer:
        from tokenizers import Tokenizer

        path = Path(directory) / "tokenizer.json"
        if not path.is_file():
            raise MissingFileError(f"{path} is missing: the tokenizer/ component needs tokenizer.json")
        try:
            return cls(Tokenizer.from_file(str(path)), max_length)
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise TokenizerError(f"cannot load {path}: {exc}") from exc

    def __call__(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        encs = self.tok.encode_batch(prompts)
        ids = [e.ids[: self.max_length] for e in encs]
        n = max(len(i) for i in ids)
        input_ids = torch.full((len(ids), n), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(ids), n), dtype=torch.bool)
        for row, seq in enumerate(ids):
            input_ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[row, : len(seq)] = True
        return input_ids, mask

    def unknown_words(self, prompt: str) -> list[str]:
        enc = self.tok.encode(prompt)
        unk = self.tok.token_to_id("[UNK]")
        return [prompt[a:b] for i, (a, b) in zip(enc.ids, enc.offsets) if i == unk]


def build_word_tokenizer(words: list[str]):
    """A lowercase word-level ``tokenizers.Tokenizer`` over ``words`` that prepends ``[CLS]``."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2}
    for w in words:
        vocab.setdefault(w.lower(), len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A", special_tokens=[("[CLS]", 2)])
    return tok


__all__ = ["PromptTokenizer", "TinyTextEncoder", "build_word_tokenizer"]
