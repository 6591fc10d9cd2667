"""torch ``scaled_dot_product_attention``: fused kernels on CPU and CUDA, never materializes P in Python."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from forwardpass.attention.mask import build_mask
from forwardpass.attention.naive import naive_attention


def sdpa_attention(
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
    if softcap is not None:  # torch's fused kernels have no logit soft-capping
        return naive_attention(q, k, v, causal=causal, scale=scale, sliding_window=sliding_window,
                               key_padding_mask=key_padding_mask, softcap=softcap)
    nq, nk = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if causal and nq == nk and sliding_window is None and key_padding_mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if causal and nq == 1 and sliding_window is None and key_padding_mask is None:
        # A single query at the last position sees every key: no mask needed (the decode fast path).
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    mask = build_mask(
        nq, nk, causal=causal, sliding_window=sliding_window, key_padding_mask=key_padding_mask,
        device=q.device
    )
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
