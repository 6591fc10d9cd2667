"""What the model runner needs of the things handed to its constructor (``engine/builder.py`` wires them
in): the model, and the optional plug-ins that see every step (LoRA's adapter mapping, MoE routing counts,
the hidden states an MTP drafter reads). Declared here as protocols, so the runner imports none of their
implementations."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from forwardpass.attention.context import AttentionContext
from forwardpass.engine.scheduling.batch import ScheduledChunk


class CausalLM(Protocol):
    """What the runner needs of a model: hidden states of the flattened batch, logits of chosen rows."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 ctx: AttentionContext) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class BatchAdapters(Protocol):
    """Per-step adapter mapping (LoRA): which rows of the flattened batch use which adapter."""

    def load_missing(self, adapter_ids: set[int]) -> dict[int, str]:
        """Make these adapters resident (reloading evicted ones); the ones that fail, with the reason."""

    def begin_step(self, row_adapters: list[tuple[int, int]]) -> None:
        """``[(adapter id or 0, number of rows)]`` for each chunk, in batch order."""

    def end_step(self) -> None: ...


class RoutingCounter(Protocol):
    """Reads the tokens each expert received in the last forward, per MoE layer, in one host copy."""

    def collect(self) -> tuple[tuple[int, ...], ...]: ...


class HiddenStateSink(Protocol):
    """Each forward pass's output hidden states, the step's chunks in the order of its rows (speculative
    decoding's MTP drafter keeps them: ``engine/speculative/mtp_stash.py``)."""

    def record_hidden(self, chunks: Sequence[ScheduledChunk], hidden: torch.Tensor) -> None: ...
