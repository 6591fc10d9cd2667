"""Prompt logprobs (vLLM's ``prompt_logprobs``): each prompt token's logprob given the tokens before it.

Computed by the runner from the hidden states it already has: every row of a prefill chunk at
position ``p < len(prompt) - 1`` predicts prompt token ``p + 1``. Chunks add their share to the
sequence's list, which goes back once, with the sequence's first sampled token (``RunnerOutput``).
Two rules keep the list complete and computed once: a request that asks for prompt logprobs never
reads the prefix cache (the scheduler skips the lookup: cached positions would have no hidden
states), and a preemption before the list went back restarts it, while one after does not redo it.
Logits are formed in slices of rows, so a long prompt never holds a [prompt, vocab] tensor at once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch

from forwardpass.engine.scheduling.batch import ScheduledChunk
from forwardpass.sampling.params import SamplingParams
from forwardpass.sampling.sampler import TokenLogprobs, token_logprobs

#: Rows per logits slice: 256 × a 152k vocabulary × 4 bytes ≈ 155 MB at most at once.
_SLICE = 256


class _PromptSequence(Protocol):
    prompt: list[int]
    params: SamplingParams
    prompt_logprobs: list[TokenLogprobs | None] | None


def add_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    chunks: Sequence[ScheduledChunk],
    sequences: Mapping[int, _PromptSequence],
) -> None:
    """Extend each asking sequence's ``prompt_logprobs`` with the positions its chunk computed."""
    row = 0
    for chunk in chunks:
        seq = sequences[chunk.seq_id]
        start, n = chunk.num_computed_tokens, chunk.num_new_tokens
        k = seq.params.prompt_logprobs
        stop = min(start + n, len(seq.prompt) - 1)  # the last prompt position predicts the first output
        if k is not None and seq.prompt_logprobs is not None and start < stop:
            if start == 0:
                seq.prompt_logprobs[:] = [None]  # the first token has no context (vLLM's None); a restart
            for a in range(start, stop, _SLICE):
                b = min(a + _SLICE, stop)
                logits = compute_logits(hidden[row + a - start : row + b - start])
                targets = torch.tensor(seq.prompt[a + 1 : b + 1], device=logits.device)
                seq.prompt_logprobs.extend(token_logprobs(logits, targets, [k] * (b - a)))
        row += n


def take_prompt_logprobs(seq: _PromptSequence) -> tuple[TokenLogprobs | None, ...] | None:
    """The complete list, once (with the first sampled token); None before, after, or if not asked."""
    lps = seq.prompt_logprobs
    if not lps or len(lps) != len(seq.prompt):
        return None
    seq.prompt_logprobs = None  # handed out: a later preemption's recompute does not redo it
    return tuple(lps)
