"""The target's hidden states, kept per sequence until the MTP layer (``mtp.py``) has read them.

The MTP layer at position ``i`` reads the target's hidden state ``h_i`` and the token ``t_{i+1}``, so it can
only run once ``t_{i+1}`` is known: a step later than the target computed ``h_i``. The runner hands each
forward pass's hidden states here (``record_hidden``: the chunks of the step, in the order of its rows), and
the proposer takes the positions it needs when it next proposes (``take``).

Positions are overwritten by later computations: a verify step computes hidden states at draft positions,
and the rejected ones among them are computed again (with the right tokens) before the MTP layer reads
them, since it reads only positions below the sequence's computed length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from forwardpass.engine.worker.plugins import HiddenStateSink


class StepChunk(Protocol):
    """What the stash reads of a scheduled chunk (``ScheduledChunk``)."""

    @property
    def seq_id(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def num_new_tokens(self) -> int: ...


class HiddenStash:
    """Per sequence, runs of consecutive positions' hidden states, in the order they were computed."""

    def __init__(self) -> None:
        self.runs: dict[int, list[tuple[int, torch.Tensor]]] = {}  # seq id -> [(first position, [n, H])]
        self.num_missing = 0  # positions asked for that no forward pass computed (prefix-cache hits)

    def record_hidden(self, chunks: Sequence[StepChunk], hidden: torch.Tensor) -> None:
        row = 0
        for chunk in chunks:
            n = chunk.num_new_tokens
            # a copy: a view would keep the whole step's hidden states alive
            self.runs.setdefault(chunk.seq_id, []).append((chunk.num_computed_tokens,
                                                            hidden[row : row + n].clone()))
            row += n

    def pending(self, seq_id: int) -> int:
        """Positions held for ``seq_id`` (a bound on the memory a sequence that never proposes holds)."""
        return sum(len(rows) for _, rows in self.runs.get(seq_id, ()))

    def take(self, seq_id: int, lo: int, hi: int, like: torch.Tensor) -> torch.Tensor:
        """The hidden states of positions ``lo .. hi - 1`` (``[hi - lo, H]``, ``like``'s width, dtype and
        device). A position no forward pass computed (its K/V came from the prefix cache) is zeros: its MTP
        entry then carries the token alone. Runs wholly before ``hi - 1`` are dropped: the MTP layer never
        needs them again (``hi - 1``, the last, is kept, for a second proposal at the same length)."""
        out = torch.zeros(hi - lo, like.shape[-1], dtype=like.dtype, device=like.device)
        have = torch.zeros(hi - lo, dtype=torch.bool)
        runs = self.runs.get(seq_id, [])
        for start, rows in runs:  # later runs overwrite earlier ones
            a, b = max(lo, start), min(hi, start + len(rows))
            if a < b:
                out[a - lo : b - lo] = rows[a - start : b - start]
                have[a - lo : b - lo] = True
        self.num_missing += int((~have).sum())
        self.runs[seq_id] = [(s, r) for s, r in runs if s + len(r) > hi - 1]
        return out

    def drop(self, seq_id: int) -> None:
        self.runs.pop(seq_id, None)


def hidden_sink(proposer: object) -> HiddenStateSink | None:
    """The runner's ``hidden_sink`` for a speculator's proposer: an MTP proposer's stash, else None."""
    stash = getattr(proposer, "stash", None)
    return stash if isinstance(stash, HiddenStash) else None
