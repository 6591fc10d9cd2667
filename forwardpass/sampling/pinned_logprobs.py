"""vLLM's ``logprob_token_ids``: the logprobs of tokens the request names, at every generated position,
whatever their rank (a classifier reading fixed label tokens needs them even when they are not in the top k).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pinned_logprobs(logits: torch.Tensor, ids: Sequence[int]) -> list[tuple[int, float, int]]:
    """(token_id, logprob, rank) of each of ``ids`` under the raw distribution of one row of ``logits``
    (rank 1 = most likely, as the sampled token's)."""
    raw = logits.float()
    picked = raw[torch.tensor(list(ids), device=raw.device)]
    ranks = (raw[None, :] > picked[:, None]).sum(-1) + 1
    return list(zip(ids, (picked - torch.logsumexp(raw, -1)).tolist(), ranks.tolist(), strict=True))
