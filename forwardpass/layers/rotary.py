"""Rotary position embeddings (RoPE), with the ``rope_scaling`` variants HF checkpoints use.

The inverse frequencies are computed exactly as transformers' ``ROPE_INIT_FUNCTIONS`` do, so
positions rotate identically; cos/sin are computed per call from the positions of the tokens in the
batch (cheap next to the matmuls, and it needs no max-length cache).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from forwardpass.errors import ConfigError


def _default_inv_freq(head_dim: int, theta: float, partial: float = 1.0) -> torch.Tensor:
    dim = int(head_dim * partial)
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths are slowed by ``factor``, short ones
    kept, and the band in between interpolated smoothly."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context_len = scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """Return (inverse frequencies, attention scaling factor applied to cos/sin)."""
    inv_freq = _default_inv_freq(head_dim, theta)
    if not scaling:
        return inv_freq, 1.0
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    raise ConfigError(
        f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)", param="rope_scaling"
    )


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None):
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(head_dim, theta, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, D]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + _rotate_half(x) * sin
