"""Per-request fault isolation in the step: one request's failure must not fail the batch.

An error attributable to one sequence (its sampling parameters, a logits processor) is found by
sampling each row alone after the batched sampler raised; the rows that fail are reported in
``RunnerOutput.failed`` and the engine core fails only their requests (the scheduler frees their
blocks). The other rows keep exactly the tokens the batch would have given them.

Before the forward pass, a sequence whose LoRA adapter cannot be made resident (evicted, and its files
changed or deleted since it was validated) is taken out of the batch the same way: the step runs
without its rows and only its request fails.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

import torch

from forwardpass.engine.scheduling.batch import SchedulerOutput
from forwardpass.sampling.sampler import Sampler, SamplingRow, TokenLogprobs

logger = logging.getLogger(__name__)
#: one row's sampled token and its logprobs
Sampled = tuple[int, TokenLogprobs | None]


def sample_isolated(
    sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow], eos_token_ids: Sequence[int]
) -> list[Sampled | str]:
    """One ``(token, logprobs)`` per row, or the reason that row's own sampling failed.

    A row's token depends only on its logits and its generator, so each row sampled alone, its seeded
    generator first rewound to where the batch found it, gets the token the batch would have given it.
    """
    states = [r.generator.get_state() if r.generator is not None else None for r in rows]
    try:
        out = sampler(logits, rows, eos_token_ids=eos_token_ids)
    except Exception:  # the rows at fault are found below
        logger.warning("the batched sampler failed; sampling each row alone to find the requests at fault",
                       exc_info=True)
    else:
        return list(zip(out.token_ids, out.logprobs))
    results: list[Sampled | str] = []
    for i, (row, state) in enumerate(zip(rows, states)):
        if row.generator is not None and state is not None:
            row.generator.set_state(state)
        try:
            one = sampler(logits[i : i + 1], [row], eos_token_ids=eos_token_ids)
            results.append((one.token_ids[0], one.logprobs[0]))
        except Exception as exc:  # noqa: BLE001 - fails this row's request only
            results.append(f"sampling failed for this request: {type(exc).__name__}: {exc}")
    return results


class _Adapters(Protocol):
    def load_missing(self, adapter_ids: set[int]) -> dict[int, str]: ...


def drop_unloadable(
    scheduled: SchedulerOutput, sequences: Mapping[int, Any], adapters: _Adapters | None
) -> tuple[SchedulerOutput, tuple[tuple[int, str], ...]]:
    """``scheduled`` without the chunks whose adapter cannot be loaded, and ``(seq_id, reason)`` for each."""
    wanted = {sequences[c.seq_id].lora_id for c in scheduled.chunks} - {0}
    if adapters is None or not wanted:
        return scheduled, ()
    broken = adapters.load_missing(wanted)
    if not broken:
        return scheduled, ()
    failed = tuple((c.seq_id, broken[sequences[c.seq_id].lora_id]) for c in scheduled.chunks
                   if sequences[c.seq_id].lora_id in broken)
    dropped = {seq_id for seq_id, _ in failed}
    return replace(scheduled, chunks=tuple(c for c in scheduled.chunks if c.seq_id not in dropped)), failed
