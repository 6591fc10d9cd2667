"""Attention behind one interface.

``attention(q, k, v, causal=..., backend=...)`` computes softmax(q·kᵀ·scale + mask)·v for

* q: ``[B, Hq, Nq, D]``, k and v: ``[B, Hkv, Nk, D]`` with ``Hq % Hkv == 0`` (grouped-query attention:
  each group of ``Hq // Hkv`` query heads shares one key/value head);
* ``causal=True``: query ``i`` sits at absolute position ``Nk - Nq + i`` (bottom-right alignment), so the
  same call serves a whole-prompt prefill (Nq == Nk), a chunked prefill and a one-token decode step;
* ``causal=False``: bidirectional self-attention (encoders, DiT) or cross-attention (k/v from another
  sequence, any Nk);
* ``sliding_window=W``: a causal query also ignores keys more than ``W - 1`` positions behind it;
* ``key_padding_mask``: ``[B, Nk]`` bool, True where the key is real (for right-padded batches);
* ``softcap=c``: scores become ``tanh(s / c) · c`` before masking (Gemma 2's attention logit cap).

Backends are registered by name; ``naive`` is the reference every other backend is tested against.
``flash`` (``flash.py``) is the tiled online-softmax algorithm written in PyTorch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from forwardpass.attention.flash import flash_attention
from forwardpass.attention.mask import build_mask
from forwardpass.attention.naive import naive_attention
from forwardpass.attention.sdpa import sdpa_attention
from forwardpass.errors import ConfigError

AttentionFn = Callable[..., torch.Tensor]

_BACKENDS: dict[str, AttentionFn] = {
    "naive": naive_attention,
    "sdpa": sdpa_attention,
    "flash": flash_attention,
}


def register_backend(name: str, fn: AttentionFn) -> None:
    """Make another implementation available under ``name`` (e.g. a tiled flash kernel)."""
    _BACKENDS[name] = fn


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_backend(name: str) -> AttentionFn:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ConfigError(
            f"unknown attention backend {name!r}; choose one of {available_backends()}",
            param="attention_backend"
        ) from None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    sliding_window: int | None = None,
    key_padding_mask: torch.Tensor | None = None,
    softcap: float | None = None,
    backend: str = "sdpa",
) -> torch.Tensor:
    """Dispatch to the named backend; see the module docstring for shapes and semantics."""
    extra = {} if softcap is None else {"softcap": softcap}  # backends registered without softcap still work
    return get_backend(backend)(
        q, k, v, causal=causal, scale=scale, sliding_window=sliding_window, key_padding_mask=key_padding_mask,
        **extra,
    )


__all__ = ["attention", "available_backends", "build_mask", "flash_attention", "get_backend",
           "register_backend"]
