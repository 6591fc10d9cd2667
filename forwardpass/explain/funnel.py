"""The sampling funnel of one drawn token, stage by stage, in the sampler's own order.

    raw logits -> logit processors (penalties, min_tokens) -> temperature -> min_p -> top_k -> top_p
    -> renormalised pool -> the draw

The stages are the ones of :class:`forwardpass.sampling.sampler.Sampler`: the processors are its own
``apply_processors``; min_p, top_k and top_p each keep a prefix of the tokens sorted by probability,
top_p measured on what min_p and top_k left (``_draw_prefix``). The draw itself is redone with the real
``Sampler`` and the request's seeded generator, so the funnel says whether it reproduced the engine's token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from forwardpass.sampling.params import SamplingParams
from forwardpass.sampling.sampler import Sampler, SamplingRow

SHOWN = 10  # funnel rows: the most likely tokens (plus the drawn one)
POOL_SHOWN = 50  # pool entries listed (the pool can be the whole vocabulary)


@dataclass
class Funnel:
    funnel: list[dict[str, Any]]  # top candidates with their probability at each stage
    candidates: list[dict[str, Any]]  # the final pool, sorted by probability (at most POOL_SHOWN)
    pool_size: int
    drawn: int  # what the sampler drew from these logits with the request's generator

    def to_dict(self) -> dict[str, Any]:
        return {"funnel": self.funnel, "candidates": self.candidates, "pool_size": self.pool_size}


def pool_mask(x: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities after temperature, tokens kept by min_p, top_k and top_p) for processed logits ``x``."""
    V = x.shape[0]
    if params.greedy:
        keep = torch.zeros(V, dtype=torch.bool)
        keep[int(x.argmax())] = True
        return torch.softmax(x.double(), -1), keep
    e = ((x - x.max()) / params.temperature).double().exp()  # p / p_max
    p_temp = e / e.sum()
    keep_min_p = e >= params.min_p
    order = torch.sort(e, descending=True, stable=True).indices
    rank = torch.empty(V, dtype=torch.long)
    rank[order] = torch.arange(V)
    keep = keep_min_p & (rank < (params.top_k if params.top_k > 0 else V))
    es = (e * keep)[order]
    mass = es.sum()
    before = es.cumsum(0) - es  # mass strictly before each sorted token
    keep_sorted = keep[order] & (before < params.top_p * mass)
    keep_sorted[0] = True  # the most likely token always survives
    out = torch.zeros(V, dtype=torch.bool)
    out[order] = keep_sorted
    return p_temp, out


def sampling_funnel(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt: Sequence[int],
    output: Sequence[int],
    generator: torch.Generator | None,
    eos: Sequence[int],
    text: Callable[[int], str],
) -> Funnel:
    """The funnel for one row of raw logits ``[V]``; ``output`` are the tokens drawn before this one."""
    sampler = Sampler()
    row = SamplingRow(params, list(prompt), list(output), generator)
    raw = logits.float()[None]
    x = sampler.apply_processors(raw, [row], list(eos))[0].clone()
    drawn = int(sampler(raw, [row], eos_token_ids=list(eos)).token_ids[0])
    p_raw = torch.softmax(raw[0].double(), -1)
    p_temp, keep = pool_mask(x, params)
    pool = p_temp * keep
    pool = pool / pool.sum()
    if params.greedy:
        min_p_ok = top_k_ok = top_p_ok = keep
    else:
        e = p_temp / p_temp.max()
        min_p_ok = e >= params.min_p
        order = torch.sort(p_temp, descending=True, stable=True).indices
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel())
        top_k_ok = rank < (params.top_k if params.top_k > 0 else order.numel())
        top_p_ok = keep | ~(min_p_ok & top_k_ok)  # top_p only judges what the others kept
    shown = torch.topk(x, min(SHOWN, x.numel())).indices.tolist()
    if drawn not in shown:
        shown.append(drawn)
    funnel = [
        {
            "token": t,
            "text": text(t),
            "raw_prob": float(p_raw[t]),
            "temp_prob": float(p_temp[t]),
            "min_p": bool(min_p_ok[t]),
            "top_k": bool(top_k_ok[t]),
            "top_p": bool(top_p_ok[t]),
            "pool_prob": float(pool[t]),
            "drawn": t == drawn,
        }
        for t in shown
    ]
    kept = keep.nonzero().squeeze(1)
    kept = kept[torch.argsort(pool[kept], descending=True, stable=True)]
    listed = kept[:POOL_SHOWN].tolist()
    if drawn not in listed and bool(keep[drawn]):  # the drawn token is always listed, in its place
        listed = sorted([*listed, drawn], key=lambda t: -float(pool[t]))
    candidates = [{"token": t, "text": text(t), "prob": float(pool[t]), "temp_prob": float(p_temp[t])}
                  for t in listed]
    return Funnel(funnel, candidates, int(kept.numel()), drawn)
