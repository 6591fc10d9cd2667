"""Request state, owned by the scheduler. One ``Sequence`` per sample; a request with ``n > 1`` has n.

The scheduler's single rule (as in vLLM v1) lives on ``num_computed_tokens``: the number of this
sequence's tokens whose K/V are in the cache. Each step moves it toward ``num_tokens``. A fresh
prompt, a prompt split into chunks, a decode step and a recompute after preemption are all the
same thing: "catch up".

Only the scheduler writes these fields (``Scheduler.schedule`` on admission and preemption,
``Scheduler.update`` for computed tokens, new tokens and finishing). Text, stop strings and logprob
formatting are not here: they belong to the front end's ``OutputProcessor``.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

from forwardpass.engine.scheduling.speculation import DraftStats
from forwardpass.lora.request import LoRARequest
from forwardpass.sampling.params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    index: int = 0  # which of the request's n samples this is
    lora_request: LoRARequest | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    seq_id: int = field(default_factory=lambda: next(_ids))
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id that ended it
    num_preemptions: int = 0
    in_runner: bool = False  # the model runner holds this sequence's tokens and block tables
    first_scheduled_time: float | None = None
    encoder_input: Any = None  # encoder–decoder models: the request's log-mel features (a tensor)
    draft_stats: DraftStats = field(default_factory=DraftStats)  # speculative decoding (engine/speculative/)

    def __post_init__(self) -> None:
        self.token_ids: list[int] = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def lora_id(self) -> int:
        return 0 if self.lora_request is None else int(self.lora_request.lora_int_id)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def check_stop(self, token: int, eos_token_ids: Container[int],
                    max_model_len: int) -> tuple[str | None, int | None]:
        """The token-level stop conditions after appending ``token``: ``(finish reason, stop token)``, or
        ``(None, None)`` to go on. Stop strings are the front end's (they need the text)."""
        p = self.params
        n_out = len(self.output_token_ids)
        if n_out >= p.min_tokens:  # no stop condition counts before min_tokens
            if not p.ignore_eos and token in eos_token_ids:
                return "stop", None
            if p.stop_token_ids and token in p.stop_token_ids:
                return "stop", token
        if p.max_tokens is not None and n_out >= p.max_tokens:
            return "length", None
        if self.num_tokens >= max_model_len:
            return "length", None
        return None, None
