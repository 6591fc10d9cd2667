"""The boolean "may attend" mask shared by every backend (True = keep)."""

from __future__ import annotations

import torch


def build_mask(
    nq: int,
    nk: int,
    *,
    causal: bool,
    sliding_window: int | None = None,
    key_padding_mask: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor | None:
    """Return a mask broadcastable to ``[B, H, Nq, Nk]``, or None when every key is visible.

    Causal masks are bottom-right aligned: query ``i`` is at absolute position ``nk - nq + i``.
    """
    mask = None
    if causal or sliding_window is not None:
        q_pos = torch.arange(nk - nq, nk, device=device).unsqueeze(1)  # [Nq, 1]
        k_pos = torch.arange(nk, device=device).unsqueeze(0)  # [1, Nk]
        mask = k_pos <= q_pos if causal else torch.ones(nq, nk, dtype=torch.bool, device=device)
        if sliding_window is not None:
            mask = mask & (k_pos > q_pos - sliding_window)
        mask = mask[None, None]  # [1, 1, Nq, Nk]
    if key_padding_mask is not None:
        kp = key_padding_mask[:, None, None, :].to(torch.bool)  # [B, 1, 1, Nk]
        mask = kp if mask is None else mask & kp
    return mask
