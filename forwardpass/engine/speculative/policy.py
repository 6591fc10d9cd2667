"""When to speculate: the scheduler asks :class:`Speculator` for each decode-ready sequence's drafts.

A verify step of ``B`` sequences each checking ``k`` drafts computes ``B (1 + k)`` tokens instead of ``B``.
While a step is memory-bound (every weight read once whatever the batch) that costs little more than a
decode step, and each draft the target accepts is a token for free; once the step is compute-bound, or
when drafts are mostly rejected, the extra tokens are a loss. The decision, per sequence and step:

* no proposals while more than ``disable_by_batch_size`` sequences run (the ridge of the roofline);
* the expected tokens of a verify of ``k`` drafts, with the request's measured per-token acceptance ``α``
  (``DraftStats``): ``E(k) = (1 - α^(k+1)) / (1 - α)`` (Leviathan et al.'s geometric model). For ngram
  drafts ``α`` is the one of drafts behind a match of the same length (a 4-token match is a far better
  guess than one recurring token), starting from the engine-wide figure for that length;
* the measured cost: the engine's decode-step time by number of rows, ``T(n)`` (``StepCosts``: a running
  mean per ``n`` over steps without prompt work, the line through them for sizes not yet seen; a
  prior of ``_PRIOR_TOKEN_COST`` of a one-row step per extra row only until two sizes are measured). A
  verify row is a decode row (the runner gives it the decode kernels), so one line covers both;
* the ``k`` that maximises the batch's tokens per second, ``(B - 1 + E(k)) / B · T(B) / T(B + k)``, if
  that beats not speculating by ``_MARGIN``; otherwise none, but every ``_PROBE_EVERY`` decode steps the
  request proposes once anyway, so a request whose text turns repetitive is noticed again.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any, Protocol, runtime_checkable

from forwardpass.config import SpeculativeConfig
from forwardpass.engine.scheduling.kv_cache_spec import KVCacheGroup
from forwardpass.engine.scheduling.speculation import DraftStats
from forwardpass.engine.speculative.ngram import NgramProposer
from forwardpass.engine.speculative.rollback import check_can_roll_back
from forwardpass.engine.speculative.stats import engine_draft_stats
from forwardpass.sampling.params import SamplingParams

# an extra row of a small step ~ 15% of a one-row step (SmolLM2 Q4_1 on one core), until measured
_PRIOR_TOKEN_COST = 0.15
_MARGIN = 1.03  # speculate only for an expected gain of at least 3% (measurements are noisy)
_PROBE_EVERY = 16  # decode steps without proposals before a request tries once more
_EMA = 0.2  # weight of a new step time in its running mean
_MAX_TRACKED = 512  # step sizes (tokens) whose time is tracked


class DraftProposer(Protocol):
    def propose(self, token_ids: Seq[int], k: int) -> tuple[int, ...]:
        """Up to ``k`` tokens to follow ``token_ids``."""


@runtime_checkable
class SequenceProposer(Protocol):
    """A proposer with per-sequence state (a draft model's KV cache): asked with the sequence itself."""

    def propose_for(self, seq: Any, k: int) -> tuple[int, ...]: ...


class StepChunk(Protocol):
    """What the cost model reads of a scheduled chunk (``ScheduledChunk``)."""

    @property
    def num_new_tokens(self) -> int: ...

    @property
    def draft_token_ids(self) -> tuple[int, ...]: ...


class Drafting(Protocol):
    """What the policy reads of a sequence (the scheduler's ``Sequence``)."""

    token_ids: list[int]
    output_token_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams
    draft_stats: DraftStats


class StepCosts:
    """Measured decode-step time by the number of rows the step computed."""

    def __init__(self) -> None:
        self.mean: dict[int, float] = {}  # rows -> running mean of the step's seconds

    def observe(self, num_tokens: int, seconds: float) -> None:
        if 0 < num_tokens <= _MAX_TRACKED and seconds > 0:
            old = self.mean.get(num_tokens)
            self.mean[num_tokens] = seconds if old is None else (1 - _EMA) * old + _EMA * seconds

    def line(self) -> tuple[float, float] | None:
        """``(a, b)`` of the least-squares line ``T(n) = a + b n`` through the measured sizes' means (a row
        costs the same whichever step it is in: the matmuls' rows, attention queries, sampling); None until
        two sizes are measured."""
        if len(self.mean) < 2:
            return None
        xs, ys = list(self.mean), list(self.mean.values())
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        slope = max(slope, 0.0)  # noise can tilt two close sizes the wrong way: more rows never cost less
        return my - slope * mx, slope

    def seconds(self, rows: int) -> float | None:
        """T(rows): measured, else on the measured line (a request that always speculates seldom runs a
        one-row step), else None."""
        if (measured := self.mean.get(rows)) is not None:
            return measured
        line = self.line()
        return line[0] + line[1] * rows if line is not None and line[0] + line[1] * rows > 0 else None

    def ratio(self, base: int, more: int) -> float:
        """T(base + more) / T(base): measured when both sizes are (the kernels' cost per row is a staircase,
        not a line), else on the measured line, else the prior."""
        measured, bigger = self.mean.get(base), self.mean.get(base + more)
        if measured is not None and bigger is not None:
            return max(1.0, bigger / measured)
        line = self.line()
        if line is not None and (t0 := line[0] + line[1] * base) > 0:
            return (t0 + line[1] * more) / t0
        return 1.0 + _PRIOR_TOKEN_COST * more / base


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a verify of ``k`` drafts emits on average when each is accepted with probability ``alpha``."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class Speculator:
    """The scheduler's plug-in (given to its constructor): drafts for one sequence, and what came of them."""

    def __init__(self, config: SpeculativeConfig, proposer: DraftProposer | SequenceProposer | None = None):
        self.config = config
        self.k = config.num_speculative_tokens
        self.proposer = proposer or NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.costs = StepCosts()
        self.engine_stats = engine_draft_stats()  # every request's verifies: a new request's prior
        self.max_step_rows: int | None = None  # limit_step_rows
        self.token_budget = 0

    def limit_step_rows(self, max_rows: int | None, token_budget: int) -> None:
        """Keep a step's rows within ``max_rows``, the most the decode kernels take (``rows.py``; None: no
        limit): a larger step leaves them for GEMMs, which cost more per row and round differently from a
        one-row step; unless the running sequences alone fill it (then plain decode steps leave them too).
        ``token_budget``: the scheduler's ``max_num_batched_tokens``."""
        self.max_step_rows, self.token_budget = max_rows, token_budget

    def drafts_for_step(self, seq: Drafting, num_new: int, budget: int, num_running: int,
                        max_model_len: int) -> tuple[int, ...]:
        """The scheduler's question: drafts to verify with this step of ``seq``. Only when the step computes
        its last known token, and no more than fit the token budget, the context window and ``max_tokens``."""
        if num_new != 1 or len(seq.token_ids) - seq.num_computed_tokens != 1:
            return ()
        room = min(budget - 1, max_model_len - len(seq.token_ids) - 1)
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - len(seq.output_token_ids) - 1)
        if self.max_step_rows is not None and num_running < self.max_step_rows:  # (past it, decode steps
            # leave those kernels too) the rows the step holds already, and one per running sequence
            room = min(room, self.max_step_rows - (self.token_budget - budget) - num_running)
        drafts = self.drafts(seq, room, num_running)
        if not drafts and (keep_up := getattr(self.proposer, "keep_up", None)) is not None:
            keep_up(seq)  # the MTP layer reads the target's hidden states even when nobody proposes
        return drafts

    def drafts(self, seq: Drafting, max_k: int, num_running: int) -> tuple[int, ...]:
        """Up to ``min(num_speculative_tokens, max_k)`` drafts for ``seq`` this step (often none)."""
        limit = self.config.disable_by_batch_size
        if max_k < 1 or (limit is not None and num_running > limit):
            return ()
        stats = seq.draft_stats
        k = min(self.k, max_k)
        batch = max(1, num_running)
        if isinstance(self.proposer, NgramProposer):  # look first: the match's length sizes the drafts
            drafts, stats.match_length = self.proposer.match(seq.token_ids, k)
            if self.config.adaptive and drafts:
                length = stats.match_length
                alpha = stats.acceptance_for(length, self.engine_stats.acceptance_for(length))
                best = self.choose_k(alpha, len(drafts), batch)
                if best == 0 and stats.steps_since_draft + 1 < _PROBE_EVERY:
                    stats.steps_since_draft += 1
                    return ()
                drafts = drafts[: best or 1]  # a probe checks one draft
            stats.steps_since_draft = 0 if drafts else stats.steps_since_draft + 1
            return drafts
        if self.config.adaptive:
            best = self.choose_k(stats.acceptance, k, batch)
            if best == 0 and stats.steps_since_draft + 1 < _PROBE_EVERY:
                stats.steps_since_draft += 1
                return ()
            k = best or 1  # a probe checks one draft
        if isinstance(self.proposer, SequenceProposer):
            drafts = self.proposer.propose_for(seq, k)
        else:
            drafts = self.proposer.propose(seq.token_ids, k)[:k]
        stats.steps_since_draft = 0 if drafts else stats.steps_since_draft + 1
        return drafts

    def choose_k(self, alpha: float, k_max: int, batch: int) -> int:
        """The number of drafts that maximises the batch's tokens per second; 0 if none beats decoding."""
        best_k, best = 0, _MARGIN
        # a draft model's forward passes (it measures them; they are outside the step times T(n)), relative
        draft_s, step_s = getattr(self.proposer, "seconds_per_draft", 0.0), self.costs.seconds(batch)
        per_draft = draft_s / step_s if draft_s and step_s else 0.0
        for k in range(1, k_max + 1):
            cost = self.costs.ratio(batch, k) + k * per_draft
            gain = (batch - 1 + expected_tokens(alpha, k)) / batch / cost
            if gain > best:
                best_k, best = k, gain
        return best_k

    def record(self, stats: DraftStats, proposed: int, accepted: int) -> None:
        """The scheduler's report of one verify: the request's estimates and the engine-wide ones."""
        stats.record(proposed, accepted)
        self.engine_stats.match_length = stats.match_length
        self.engine_stats.record(proposed, accepted)

    def observe_step(self, chunks: Seq[StepChunk], seconds: float) -> None:
        """A step's time, for the cost model: only steps of decode and verify rows (prompt work costs more per
        row, and its chunks would pass for a verify of that many rows)."""
        if all(c.num_new_tokens == 1 + len(c.draft_token_ids) for c in chunks):
            self.costs.observe(sum(c.num_new_tokens for c in chunks), seconds)

    def release(self, seq_id: int) -> None:
        """The scheduler freed ``seq_id`` (finished or preempted): a draft model returns its cache blocks."""
        release = getattr(self.proposer, "release", None)
        if release is not None:
            release(seq_id)


def build_speculator(config: SpeculativeConfig | None, groups: Seq[KVCacheGroup],
                     draft_target: dict[str, Any] | None = None) -> Speculator | None:
    """The engine's speculator for ``config`` (None: off); a ``ConfigError`` if the model's cache cannot roll
    back rejected drafts. ``draft_target``: the builder's target_dir, engine, target_vocab, and for mtp the
    target model and its plan."""
    if config is None:
        return None
    check_can_roll_back(groups)
    t = draft_target or {}
    if config.method == "draft_model":
        from forwardpass.engine.speculative.draft import build_draft_proposer

        return Speculator(config, build_draft_proposer(config, t["target_dir"], t["engine"],
                                                       t["target_vocab"], target_groups=groups))
    if config.method == "mtp":
        from forwardpass.engine.speculative.mtp_build import build_mtp_proposer

        return Speculator(config, build_mtp_proposer(config, t["target_dir"], t["engine"], t["target"],
                                                     t["plan"], target_groups=groups))
    return Speculator(config)
