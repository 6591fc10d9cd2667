"""Logit processors that touch a few (row, token) entries: min_tokens masking and the three penalties.

Each works in place on a [B, V] float32 tensor through flat indices ``row * V + token``, so the cost is
proportional to the number of tokens involved, never to B * V, and there is no Python loop over tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

TokenIds = Sequence[int] | torch.Tensor


def as_ids(ids: TokenIds) -> torch.Tensor:
    """Token ids as a 1-D int64 CPU-or-device tensor; tensors pass through without a copy."""
    if isinstance(ids, torch.Tensor):
        return ids.reshape(-1).long()
    return torch.as_tensor(ids, dtype=torch.long).reshape(-1)


def flat_keys(
    rows: Sequence[int], ids: Sequence[torch.Tensor], vocab: int, device: torch.device
) -> torch.Tensor:
    """``row * vocab + token`` for each (row, token) pair; refuses ids outside the vocabulary.

    An out-of-range id would silently write into another row's logits, so it is an error here.
    """
    lengths = torch.tensor([t.numel() for t in ids], dtype=torch.long)
    if int(lengths.sum()) == 0:
        return torch.empty(0, dtype=torch.long, device=device)
    tokens = torch.cat([t.to(device) for t in ids])
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"token id {lo if lo < 0 else hi} is outside the model vocabulary [0, {vocab})")
    owner = torch.repeat_interleave(torch.tensor(list(rows), dtype=torch.long), lengths).to(device)
    return owner * vocab + tokens


def mask_tokens(logits: torch.Tensor, keys: torch.Tensor) -> None:
    """Make the tokens at ``keys`` impossible (min_tokens: EOS / stop tokens may not come yet)."""
    logits.view(-1).index_fill_(0, keys, float("-inf"))


def apply_repetition_penalty(logits: torch.Tensor, keys: torch.Tensor, penalty: torch.Tensor) -> None:
    """HF / CTRL repetition penalty on every token seen in prompt or output.

    ``penalty`` is per batch row [B]. Positive logits are divided, the others multiplied, so the token
    always becomes less likely. Duplicate keys write the same value, so no dedup is needed (as in HF).
    """
    if keys.numel() == 0:
        return
    flat = logits.view(-1)
    vals = flat[keys]
    p = penalty[keys // logits.shape[1]]
    flat[keys] = torch.where(vals > 0, vals / p, vals * p)


def apply_presence_frequency(
    logits: torch.Tensor, keys: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor
) -> None:
    """OpenAI penalties on generated tokens: ``logit -= presence * (count > 0) + frequency * count``.

    ``keys`` holds one entry per generated token (repeats included); ``presence`` / ``frequency`` are
    per batch row [B].
    """
    if keys.numel() == 0:
        return
    uniq, counts = torch.unique(keys, return_counts=True)
    row = uniq // logits.shape[1]
    delta = presence[row] + frequency[row] * counts.to(logits.dtype)
    logits.view(-1).index_add_(0, uniq, -delta)
