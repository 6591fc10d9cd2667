"""FlashAttention, the algorithm, in PyTorch: tiles over K/V with an online softmax, never N×N.

``naive.py`` computes the scores ``S = q·kᵀ`` for every (query, key) pair, then ``P = softmax(S)``, then
``P·v``: ``Nq × Nk`` floats per head live at once (1 GiB in fp32 at N = 16384). FlashAttention
(Dao et al., 2022) computes the same output one ``block_q × block_k`` tile of ``S`` at a time. For
each tile of queries it walks the key tiles and keeps, per query row,

* ``m`` — the largest score seen so far (the running max),
* ``l`` — the sum of ``exp(s - m)`` over the keys seen so far (the running denominator),
* ``acc`` — the sum of ``exp(s - m) · v`` over the keys seen so far (the unnormalised output).

When a new tile raises the max from ``m`` to ``m'``, everything accumulated so far was weighted by
``exp(s - m)`` and must be weighted by ``exp(s - m')``: ``l`` and ``acc`` are multiplied by
``alpha = exp(m - m')`` before the tile's own contribution is added. After the last key tile the
output is ``acc / l``. Exactly softmax(S)·v, up to rounding, with ``O(block_q · block_k)`` memory for
scores instead of ``O(Nq · Nk)``.

Tiles that the mask removes entirely (above the causal diagonal, or behind every query's sliding
window) are skipped without being computed — this is where causal attention saves half the work and
a window turns ``O(N²)`` into ``O(N · W)``.

Layout and semantics are those of ``forwardpass.attention.attention``: q ``[B, Hq, Nq, D]``, k/v
``[B, Hkv, Nk, D]`` (``Hq % Hkv == 0``: GQA/MQA), causal queries aligned to the *end* of the keys
(query ``i`` sits at key position ``Nk - Nq + i``), ``sliding_window=W`` keeps the ``W`` most recent
keys up to and including the query's own position, ``key_padding_mask`` ``[B, Nk]``, and
``softcap`` (Gemma 2) applies ``tanh(s / c) · c`` to the scores before the mask. A query that may see
no key outputs zeros, as in ``naive``.

Selected by ``attention_backend="flash"``. Written for reading next to ``naive.py``; on CPU the
Python loop over tiles makes it slower than ``sdpa`` for short sequences.

TODO(gpu): a Triton kernel of this same algorithm (one program per (batch·head, query tile), the
key-tile loop inside the kernel with ``m``/``l``/``acc`` in registers, masked tiles skipped by loop
bounds), registered as ``"flash"`` when ``q.is_cuda`` and tested against this function under a
``gpu`` pytest mark. No GPU was available when this was written.
"""

from __future__ import annotations

import math

import torch

DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 128


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    sliding_window: int | None = None,
    key_padding_mask: torch.Tensor | None = None,
    softcap: float | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
) -> torch.Tensor:
    """softmax(q·kᵀ·scale + mask)·v computed tile by tile; see the module docstring."""
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block_q and block_k must be >= 1, got {block_q}, {block_k}")
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    # GQA without copying K/V: the `group` query heads sharing a KV head become extra query rows.
    qg = q.float().reshape(b, hkv, group, nq, d)
    kf, vf = k.float().unsqueeze(2), v.float().unsqueeze(2)  # [B, Hkv, 1, Nk, D]
    out = torch.empty(b, hkv, group, nq, v.shape[-1], dtype=torch.float32, device=q.device)
    offset = nk - nq  # absolute key position of query 0 (bottom-right alignment)
    for qs in range(0, nq, block_q):
        qe = min(qs + block_q, nq)
        q_tile = qg[:, :, :, qs:qe] * scale
        q_pos = torch.arange(qs + offset, qe + offset, device=q.device)[:, None]  # [bq, 1]
        # The keys any query of this tile may see: [lo, hi).
        hi = min(nk, qe + offset) if causal else nk
        lo = max(0, qs + offset - sliding_window + 1) if sliding_window is not None else 0
        m = torch.full((b, hkv, group, qe - qs, 1), float("-inf"), device=q.device)
        l_sum = torch.zeros_like(m)
        acc = torch.zeros(b, hkv, group, qe - qs, v.shape[-1], device=q.device)
        for ks in range(lo - lo % block_k, hi, block_k):
            ke = min(ks + block_k, nk)
            s = torch.matmul(q_tile, kf[:, :, :, ks:ke].transpose(-1, -2))  # [B, Hkv, G, bq, bk]
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            keep = _tile_mask(q_pos, (qs + offset, qe - 1 + offset), ks, ke, causal, sliding_window,
                              key_padding_mask)
            if keep is not None:
                s = s.masked_fill(~keep, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # rows with no key yet
            p = torch.exp(s - m_safe)  # masked scores: exp(-inf) = 0
            alpha = torch.exp(m - m_safe)  # rescales what was accumulated under the old max
            l_sum = l_sum * alpha + p.sum(-1, keepdim=True)
            acc = acc * alpha + torch.matmul(p, vf[:, :, :, ks:ke])
            m = m_new
        out[:, :, :, qs:qe] = torch.where(l_sum > 0, acc / l_sum.clamp_min(1e-30), torch.zeros_like(acc))
    return out.reshape(b, hq, nq, -1).to(q.dtype)


def _tile_mask(
    q_pos: torch.Tensor,
    q_range: tuple[int, int],
    ks: int,
    ke: int,
    causal: bool,
    sliding_window: int | None,
    key_padding_mask: torch.Tensor | None,
) -> torch.Tensor | None:
    """The keep-mask of one tile, broadcastable to ``[B, Hkv, G, bq, bk]``, or None if all is kept."""
    k_pos = torch.arange(ks, ke, device=q_pos.device)[None, :]  # [1, bk]
    keep = None
    first_q, last_q = q_range
    if causal and ke - 1 > first_q:  # the tile crosses the diagonal
        keep = k_pos <= q_pos
    if sliding_window is not None and ks <= last_q - sliding_window:  # some key is behind a window
        inside = k_pos > q_pos - sliding_window
        keep = inside if keep is None else keep & inside
    if keep is not None:
        keep = keep[None, None, None]
    if key_padding_mask is not None:
        kp = key_padding_mask[:, None, None, None, ks:ke].to(torch.bool)  # [B, 1, 1, 1, bk]
        keep = kp if keep is None else keep & kp
    return keep


def tile_footprint_bytes(d: int, block_q: int = DEFAULT_BLOCK_Q, block_k: int = DEFAULT_BLOCK_K,
                         elem: int = 4) -> int:
    """Working set of one (query tile, key tile) step per head: the q tile, one K and one V tile, the
    score/probability tile, and the running ``m``, ``l`` and accumulator — what must stay in SRAM
    (GPU) or cache (CPU) for the tile loop to run at compute speed."""
    return elem * (block_q * d + 2 * block_k * d + block_q * block_k + 2 * block_q + block_q * d)
