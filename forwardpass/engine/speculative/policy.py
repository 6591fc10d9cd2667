"""When to speculate: the scheduler asks :class:`Speculator` for each decode-ready sequence's drafts.

A verify step of ``B`` sequences each checking ``k`` drafts computes ``B (1 + k)`` tokens instead of ``B``.
While a step is memory-bound (every weight read once whatever the batch) that costs little more than a
decode step, and each draft the target accepts is a token for free; once the step is compute-bound, or
when drafts are mostly rejected, the extra tokens are a loss. The decision, per sequence and step:

* no proposals while more than ``disable_by_batch_size`` sequences run (the ridge of the roofline);
* the expected tokens of a verify of ``k`` drafts, with the request's measured per-token acceptance ``α``
  (``DraftStats``): ``E(k) = (1 - α^(k+1)) / (1 - α)`` (Leviathan et al.'s geometric model);
* the measured cost: the engine's step time by number of tokens, ``T(n)`` (``StepCosts``: a running mean
  per ``n``, a prior of ``_PRIOR_TOKEN_COST`` of a one-token step per extra token until measured);
* the ``k`` that maximises the batch's tokens per second, ``(B - 1 + E(k)) / B · T(B) / T(B + k)``, if
  that beats not speculating by ``_MARGIN``; otherwise none, but every ``_PROBE_EVERY`` decode steps the
  request proposes once anyway, so a request whose text turns repetitive is noticed again.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

from forwardpass.config import SpeculativeConfig
from forwardpass.engine.scheduling.kv_cache_spec import KVCacheGroup
from forwardpass.engine.speculative.ngram import NgramProposer
from forwardpass.engine.speculative.rollback import check_can_roll_back
from forwardpass.engine.speculative.stats import DraftStats
from forwardpass.sampling.params import SamplingParams

_PRIOR_TOKEN_COST = 0.1  # an extra token of a small step ~ 10% of a one-token step, until measured
_MARGIN = 1.03  # speculate only for an expected gain of at least 3% (measurements are noisy)
_PROBE_EVERY = 16  # decode steps without proposals before a request tries once more
_EMA = 0.2  # weight of a new step time in its running mean
_MAX_TRACKED = 512  # step sizes (tokens) whose time is tracked


class DraftProposer(Protocol):
    def propose(self, token_ids: Seq[int], k: int) -> tuple[int, ...]:
        """Up to ``k`` tokens to follow ``token_ids``."""


class Drafting(Protocol):
    """What the policy reads of a sequence (the scheduler's ``Sequence``)."""

    token_ids: list[int]
    output_token_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams
    draft_stats: DraftStats


class StepCosts:
    """Measured step time by the number of tokens the step computed."""

    def __init__(self) -> None:
        self.mean: dict[int, float] = {}

    def observe(self, num_tokens: int, seconds: float) -> None:
        if 0 < num_tokens <= _MAX_TRACKED and seconds > 0:
            old = self.mean.get(num_tokens)
            self.mean[num_tokens] = seconds if old is None else (1 - _EMA) * old + _EMA * seconds

    def ratio(self, base: int, more: int) -> float:
        """T(base + more) / T(base): measured when both are, else the prior."""
        t0, t1 = self.mean.get(base), self.mean.get(base + more)
        if t0 is not None and t1 is not None:
            return t1 / t0
        return 1.0 + _PRIOR_TOKEN_COST * more / base


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a verify of ``k`` drafts emits on average when each is accepted with probability ``alpha``."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class Speculator:
    """The scheduler's plug-in (given to its constructor): drafts for one sequence, and what came of them."""

    def __init__(self, config: SpeculativeConfig, proposer: DraftProposer | None = None):
        self.config = config
        self.k = config.num_speculative_tokens
        self.proposer = proposer or NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.costs = StepCosts()

    def drafts_for_step(self, seq: Drafting, num_new: int, budget: int, num_running: int,
                        max_model_len: int) -> tuple[int, ...]:
        """The scheduler's question: drafts to verify with this step of ``seq``. Only when the step computes
        its last known token, and no more than fit the token budget, the context window and ``max_tokens``."""
        if num_new != 1 or len(seq.token_ids) - seq.num_computed_tokens != 1:
            return ()
        room = min(budget - 1, max_model_len - len(seq.token_ids) - 1)
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - len(seq.output_token_ids) - 1)
        return self.drafts(seq, room, num_running)

    def drafts(self, seq: Drafting, max_k: int, num_running: int) -> tuple[int, ...]:
        """Up to ``min(num_speculative_tokens, max_k)`` drafts for ``seq`` this step (often none)."""
        limit = self.config.disable_by_batch_size
        if max_k < 1 or (limit is not None and num_running > limit):
            return ()
        stats = seq.draft_stats
        k = min(self.k, max_k)
        if self.config.adaptive:
            best = self.choose_k(stats.acceptance, k, max(1, num_running))
            if best == 0 and stats.steps_since_draft + 1 < _PROBE_EVERY:
                stats.steps_since_draft += 1
                return ()
            k = best or 1  # a probe checks one draft
        drafts = self.proposer.propose(seq.token_ids, k)[:k]
        stats.steps_since_draft = 0 if drafts else stats.steps_since_draft + 1
        return drafts

    def choose_k(self, alpha: float, k_max: int, batch: int) -> int:
        """The number of drafts that maximises the batch's tokens per second; 0 if none beats decoding."""
        best_k, best = 0, _MARGIN
        for k in range(1, k_max + 1):
            gain = (batch - 1 + expected_tokens(alpha, k)) / batch / self.costs.ratio(batch, k)
            if gain > best:
                best_k, best = k, gain
        return best_k

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.costs.observe(num_tokens, seconds)


def build_speculator(config: SpeculativeConfig | None, groups: Seq[KVCacheGroup]) -> Speculator | None:
    """The engine's speculator for ``config`` (None: off); a ``ConfigError`` if the model's cache cannot roll
    back rejected drafts."""
    if config is None:
        return None
    check_can_roll_back(groups)
    return Speculator(config)
