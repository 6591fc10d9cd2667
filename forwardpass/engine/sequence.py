"""Request state. One ``Sequence`` per generated sample; a request with ``n > 1`` owns n of them.

The scheduler's single rule (as in vLLM v1) lives on ``num_computed_tokens``: the number of this
sequence's tokens whose K/V are in the cache. Each step moves it toward ``num_tokens``. A fresh
prompt, a prompt split into chunks, a decode step and a recompute after preemption are all the
same thing: "catch up".
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from forwardpass.sampling.params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    index: int = 0  # which of the request's n samples this is
    generator: torch.Generator | None = None
    lora_request: Any = None  # forwardpass.lora.request.LoRARequest, or None for the base model
    arrival_time: float = field(default_factory=time.monotonic)

    seq_id: int = field(default_factory=lambda: next(_ids))
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_preemptions: int = 0
    output_text: str = ""
    logprobs: list[Any] = field(default_factory=list)  # sampler's TokenLogprobs, one per output token
    logprob_dicts: list[Any] = field(default_factory=list)  # the same as vLLM-style dicts, built once each
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    detokenizer: Any = None

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
