"""The typed data flow of one engine step (frozen: nothing downstream can change what upstream decided).

    Scheduler.schedule() ─► SchedulerOutput ─► ModelRunner.execute() ─► RunnerOutput
            ▲                                                               │
            └──────────── Scheduler.update(SchedulerOutput, RunnerOutput) ◄─┘ ─► [TokenDelta]

The runner keeps its own mirror of each sequence it has seen (tokens, block tables, sampling
generator); ``SchedulerOutput`` carries a sequence's full data once (``NewSequence``, again after a
preemption) and afterwards only what changed, so a step costs O(batch), not O(tokens so far).
``TokenDelta`` is all the engine core reports about a request: the front end's ``OutputProcessor``
turns deltas into text and ``RequestOutput``s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from forwardpass.sampling.params import SamplingParams
from forwardpass.sampling.sampler import TokenLogprobs


@dataclass(frozen=True)
class NewSequence:
    """Everything the runner needs about a sequence it does not hold (new, or resumed after preemption)."""

    seq_id: int
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]  # empty unless resumed after a preemption
    params: SamplingParams
    sample_index: int  # which of the request's n samples (seeds its generator)
    lora_id: int  # 0 = the base model
    encoder_input: torch.Tensor | None = None  # encoder–decoder models: log-mel features (encoder_step.py)


@dataclass(frozen=True)
class ScheduledChunk:
    """One sequence's share of the step: compute tokens ``[num_computed_tokens, + num_new_tokens)``."""

    seq_id: int
    num_computed_tokens: int  # before this step
    num_new_tokens: int
    new_block_ids: tuple[tuple[int, ...], ...]  # appended to each KV group's block table this step
    is_decode: bool = False  # one new token of a sequence that has generated before (not prompt work)
    # speculative decoding: proposed tokens after the sequence's known ones, counted in num_new_tokens; the
    # runner verifies them in this step's forward pass (worker/sample_step.py, engine/speculative/verify.py)
    draft_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class SchedulerOutput:
    new_sequences: tuple[NewSequence, ...]
    chunks: tuple[ScheduledChunk, ...]  # batch order: one-token chunks first
    finished_seq_ids: tuple[int, ...]  # finished or aborted since the last step: the runner forgets them
    num_preempted: int = 0

    @property
    def total_num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True)
class RunnerOutput:
    """Sampled tokens of the sequences whose known tokens were all computed this step: one entry per token,
    a sequence that verified drafts has its accepted ones and the next, consecutively."""

    seq_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs | None, ...]
    # tokens routed to each expert this step, per MoE layer ([layer][expert]); None for dense models
    routing_counts: tuple[tuple[int, ...], ...] | None = None
    # sequences whose own sampling failed this step, ``(seq_id, reason)``: only their requests fail
    failed: tuple[tuple[int, str], ...] = ()
    # ``(seq_id, logprobs of each prompt token)`` with a sequence's first sampled token (prompt_logprobs)
    prompt_logprobs: tuple[tuple[int, tuple[TokenLogprobs | None, ...]], ...] = ()


EMPTY_RUNNER_OUTPUT = RunnerOutput((), (), ())


@dataclass(frozen=True)
class TokenDelta:
    """What one step added to one sample of a request. The engine core sends nothing else."""

    request_id: str
    index: int  # which of the request's n samples
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] | None
    finish_reason: str | None = None  # "stop" or "length" (token-level); stop strings are the front end's
    stop_reason: int | None = None  # the stop token id
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None  # once, with the first token
    num_draft_tokens: int = 0  # speculative decoding: drafts verified this step ...
    num_accepted_tokens: int = 0  # ... and accepted (they are among token_ids)
