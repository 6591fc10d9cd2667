"""Reference attention: materializes the scores S = q·kᵀ and probabilities P = softmax(S) in full.

It costs O(Nq·Nk) memory per head — exactly the traffic a fused (flash) kernel avoids — and is kept
simple on purpose: every faster backend is tested against it.
"""

from __future__ import annotations

import math

import torch

from forwardpass.attention.mask import build_mask


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    sliding_window: int | None = None,
    key_padding_mask: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    _, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    group = hq // hkv
    if group > 1:  # grouped-query attention: each KV head serves `group` query heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # S: [B, H, Nq, Nk]
    if softcap is not None:  # Gemma 2: squash the logits into (-softcap, softcap)
        s = torch.tanh(s / softcap) * softcap
    mask = build_mask(
        nq, nk, causal=causal, sliding_window=sliding_window, key_padding_mask=key_padding_mask,
        device=q.device
    )
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1)  # P: [B, H, Nq, Nk]
    p = torch.nan_to_num(p, nan=0.0)  # a query that may see no key at all outputs zeros
    return torch.matmul(p, v.float()).to(q.dtype)
