"""Compressed attention (DeepSeek-V4): the math of one sequence, independent of where its tensors live.

A query at position ``t`` attends, in one softmax with a learned per-head sink logit, to

* the shared K=V vectors of the last ``window`` tokens (``t - window < s <= t``), and
* compressed entries of the history: entry ``e`` pools the tokens of window ``[e·m, (e+1)·m)`` and
  becomes visible once that window is complete (``e < (t + 1) // m``).

``pool_entries`` builds entries from the per-token kv / gate projections: a softmax over the window's
tokens per channel (gate plus a learned per-slot bias). HCA pools one window; CSA pools two
overlapping ones: the second half-series (``Cb``) of window ``e`` and the first (``Ca``) of window
``e - 1`` (window 0 has no predecessor: zero weight). A CSA layer keeps only the top ``k`` entries of
its lightning indexer (``index_scores``: ``Σ_h w_h · ReLU(q_h · k_e)``) per query.

Rotary embeddings rotate the *trailing* ``rope_dim`` channels over adjacent pairs, written back in
place (``rotate_interleaved``); since V = K, the attention output's rotary part is rotated back by the
query's position afterwards, so each entry contributes a function of the relative distance only.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last ``2 · cos.shape[-1]`` channels of ``x`` over pairs ``(x0, x1), (x2, x3), ...``
    (in float32, results in place of the pairs). ``cos``/``sin`` broadcast against ``x[..., ::2]``'s
    rotary part (``[T, R/2]`` with ``[T, R]`` rows, or ``[T, 1, R/2]`` with ``[T, H, R]``)."""
    r = 2 * cos.shape[-1]
    rope = x[..., -r:].float()
    x1, x2 = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :-r], rotated], dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm in float32; the (float32) weight multiplies before the cast back, as DeepSeek-V4 does.
    ``weight=None``: the unweighted form (q heads, hyper-connection inputs)."""
    xf = x.float()
    if weight is None:
        return x * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps).to(x.dtype)
    return (weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def pool_entries(
    kv: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, m: int, overlap: bool, e0: int, e1: int
) -> torch.Tensor:
    """Entries ``e0 .. e1 - 1`` (before their norm and rotary) from the projections ``kv``/``gate``
    ``[N, W]`` of the positions from ``(e0 - 1)·m`` (CSA, ``e0 > 0``) or ``e0·m`` on; ``bias [m, W]``.
    CSA (``overlap``): ``W = 2·D``, ``Ca = [..., :D]``, ``Cb = [..., D:]``. Returns ``[e1 - e0, D]``."""
    n = e1 - e0
    if not overlap:
        x = kv[: n * m].view(n, m, -1)
        g = gate[: n * m].view(n, m, -1) + bias
        return (x * g.softmax(dim=1, dtype=torch.float32).to(x.dtype)).sum(dim=1)
    d = kv.shape[-1] // 2
    lead = m if e0 > 0 else 0  # the closed window before e0 comes first
    cur = kv[lead : lead + n * m].view(n, m, 2 * d)
    cur_g = gate[lead : lead + n * m].view(n, m, 2 * d) + bias
    if e0 > 0:
        prev, prev_g = kv[: n * m].view(n, m, 2 * d), gate[: n * m].view(n, m, 2 * d) + bias
    else:  # window 0 has no predecessor: zero kv at -inf gate (softmax weight 0)
        prev = torch.cat([cur.new_zeros(1, m, 2 * d), cur[:-1]])
        prev_g = torch.cat([cur_g.new_full((1, m, 2 * d), NEG_INF), cur_g[:-1]])
    x = torch.cat([prev[..., :d], cur[..., d:]], dim=1)  # [n, 2m, D]
    g = torch.cat([prev_g[..., :d], cur_g[..., d:]], dim=1)
    return (x * g.softmax(dim=1, dtype=torch.float32).to(x.dtype)).sum(dim=1)


def visible_entries(positions: torch.Tensor, num_entries: int, m: int) -> torch.Tensor:
    """``[n, E]`` bool: entry ``e`` is complete for the query at position ``t`` (``e < (t + 1) // m``)."""
    return torch.arange(num_entries, device=positions.device)[None, :] < ((positions + 1) // m)[:, None]


def index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    """The lightning indexer's ``Σ_h w_h · ReLU(q_h · k_e) · scale``: q ``[n, H, d]``, keys ``[E, d]``,
    weights ``[n, H]`` → ``[n, E]`` (float32)."""
    scores = torch.relu(torch.matmul(q.float(), keys.float().t())) * scale  # [n, H, E]
    return (scores * weights.float()[..., None]).sum(dim=1)


def top_k_bias(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """``[n, E]`` additive bias: 0 on each query's top-``k`` visible entries, -inf elsewhere.

    Equal scores (an entry no indexer head scores above zero gets exactly 0) go to the lower index: a
    stable sort, because ``torch.topk`` breaks ties differently for rows of different lengths, which
    would make a chunked prefill pick other entries than a one-shot one."""
    scores = scores.masked_fill(~visible, NEG_INF)
    picked = scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    keep = (
        torch.zeros_like(visible).scatter_(1, picked, True) & visible
    )  # a pick past the causal limit is dropped
    return torch.zeros_like(scores).masked_fill(~keep, NEG_INF)


def sink_attention(
    q: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """Single-head-KV attention with a per-head sink logit in the softmax (its probability mass is
    dropped). q ``[n, H, D]``, kv ``[N, D]`` (key = value), bias ``[n, N]`` → ``[n, H, D]``."""
    logits = torch.matmul(q.transpose(0, 1), kv.t()) * scale + bias[None].to(q.dtype)  # [H, n, N]
    sink = sinks.reshape(-1, 1, 1).expand(-1, q.shape[0], 1)
    logits = torch.cat([logits.float(), sink.float()], dim=-1)  # the (float32) sink makes the softmax float32
    logits = logits - logits.amax(dim=-1, keepdim=True)
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(kv.dtype)
    return torch.matmul(probs, kv).transpose(0, 1)
