"""Paged attention: keys and values read through a block table from a pool of fixed-size blocks.

The KV cache of one layer is ``[2, num_blocks, block_size, Hkv, D]``. A sequence owns a list of block
ids (its block table); token ``t`` of the sequence lives in block ``table[t // block_size]`` at offset
``t % block_size``. Blocks need not be contiguous or in order, which is what lets the engine share
prefix blocks between requests and hand blocks back the moment a request ends.

This is the PyTorch formulation (gather the blocks, then attend over the live length only). A CUDA
build would use a kernel that reads blocks in place; the semantics, and the tests against ``naive``,
are the same.
"""

from __future__ import annotations

import torch

from forwardpass.attention import attention


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new keys/values ``[T, Hkv, D]`` at flat slots ``slot_mapping`` ``[T]`` (rounded to the cache's
    dtype where it is narrower: ``kv_cache_dtype``)."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    flat[0].index_copy_(0, slot_mapping, k.to(flat.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(flat.dtype))


def gather_kv(kv_cache: torch.Tensor, block_tables: torch.Tensor,
              length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Read the first ``length`` keys/values of each sequence as ``[B, Hkv, length, D]`` each.

    ``block_tables`` is ``[B, max_blocks]`` (or one sequence's ``[max_blocks]``, giving ``B = 1``).
    index_select over whole blocks is a row memcpy; advanced indexing (``cache[:, tables]``) takes
    torch's generic gather path and was 3x slower, the largest cost of a batch-64 decode step.
    """
    tables = block_tables.view(-1, block_tables.shape[-1])
    b = tables.shape[0]
    block_size, hkv, d = kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]
    nblocks = -(-length // block_size)
    flat = tables[:, :nblocks].reshape(-1)
    k = kv_cache[0].index_select(0, flat).view(b, nblocks * block_size, hkv, d)[:, :length].transpose(1, 2)
    v = kv_cache[1].index_select(0, flat).view(b, nblocks * block_size, hkv, d)[:, :length].transpose(1, 2)
    return k, v


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    backend: str = "sdpa",
) -> torch.Tensor:
    """One query per sequence. q: ``[B, Hq, D]`` → ``[B, Hq, D]``; each attends to its
    ``seq_lens[b]`` keys."""
    b = q.shape[0]
    k, v = (t.to(q.dtype) for t in gather_kv(kv_cache, block_tables, max_len))
    pad_mask = None
    if b > 1 or sliding_window is not None:
        pos = torch.arange(max_len, device=q.device)[None, :]
        pad_mask = pos < seq_lens[:, None]
        if sliding_window is not None:
            pad_mask = pad_mask & (pos >= seq_lens[:, None] - sliding_window)
    out = attention(q.unsqueeze(2), k, v, causal=False, scale=scale, key_padding_mask=pad_mask,
                    softcap=softcap, backend=backend)
    return out.squeeze(2)


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    backend: str = "sdpa",
) -> torch.Tensor:
    """A chunk of ``Nq`` queries (the last ``Nq`` positions of a ``context_len`` context), causal.
    q: ``[Nq, Hq, D]`` → ``[Nq, Hq, D]``."""
    k, v = (t.to(q.dtype) for t in gather_kv(kv_cache, block_table, context_len))
    out = attention(
        q.transpose(0, 1).unsqueeze(0), k, v, causal=True, scale=scale, sliding_window=sliding_window,
        softcap=softcap, backend=backend,
    )
    return out.squeeze(0).transpose(0, 1)
