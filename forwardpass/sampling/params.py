"""``SamplingParams``: what a request asks of the sampler and the stop checker, validated like vLLM.

Validation happens once, in ``__post_init__`` (and again on ``replace``), so the sampler and the
engine can trust every field. Each error names the field, the value and the allowed range; the server
turns it into an OpenAI 400 with ``param`` set to the field.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

from forwardpass.errors import SamplingParamsError
from forwardpass.sampling.reasoning_budget import ReasoningBudget
from forwardpass.sampling.whisper_rules import WhisperRules
from forwardpass.structured.params import StructuredOutputsParams

#: Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``).
SAMPLING_EPS = 1e-5
#: Largest ``logprobs`` a request may ask for (vLLM's default ``max_logprobs``; OpenAI's limit).
MAX_LOGPROBS = 20
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
#: Caps that keep every field inside what the sampler's int64 / float32 tensors can hold. The engine
#: checks the model-dependent ones again (``top_k`` <= vocabulary, token ids < vocabulary).
MAX_N = 1024
MAX_TOP_K = 2**31 - 1
MAX_TOKENS = 2**31 - 1
MAX_TOKEN_ID = 2**31 - 1
MAX_STOP_STRINGS = 1024
#: OpenAI's range for ``logit_bias`` values (added to the logit of the token).
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1 << 16


@dataclass
class SamplingParams:
    """Sampling and stopping options of one request (vLLM semantics, OpenAI ranges)."""

    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = disabled; stored as -1
    min_p: float = 0.0
    presence_penalty: float = 0.0  # on generated tokens only
    frequency_penalty: float = 0.0  # on generated tokens only
    repetition_penalty: float = 1.0  # HF/CTRL style, on prompt + generated tokens
    seed: int | None = None
    stop: str | list[str] | None = None  # normalized to list[str]
    stop_token_ids: list[int] | None = None  # normalized to list[int]
    max_tokens: int | None = 16  # None = until the context window is full
    min_tokens: int = 0  # EOS / stop tokens are masked until this many were generated
    ignore_eos: bool = False
    logprobs: int | None = None  # k >= 0: chosen token's logprob + the k most likely (-1: all)
    prompt_logprobs: int | None = None  # k >= 0: each prompt token's logprob + the k most likely there
    logprob_token_ids: list[int] | None = None  # with logprobs: these tokens' logprobs too (vLLM's)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # constrain the output to a JSON schema / regex / choice / grammar (xgrammar); a dict is converted
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled (None = all)
    reasoning_budget: ReasoningBudget | None = None  # force the reasoning's closing tag after N tokens
    # Whisper's suppress / timestamp filters (forwardpass/transcription.py)
    whisper_rules: WhisperRules | None = None

    def __post_init__(self) -> None:
        self.n = _int("n", self.n, lo=1, hi=MAX_N)
        self.temperature = _float("temperature", self.temperature, lo=0.0, hi=1e6)
        self.top_p = _float("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        self.top_k = _int(
            "top_k", self.top_k, lo=-1, hi=MAX_TOP_K, hint=f"-1 or 0 (disabled), or 1..{MAX_TOP_K}"
        )
        if self.top_k == 0:
            self.top_k = -1  # one spelling of "disabled", so equal requests compare equal
        self.min_p = _float("min_p", self.min_p, lo=0.0, hi=1.0)
        self.presence_penalty = _float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        self.frequency_penalty = _float("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        self.repetition_penalty = _float(
            "repetition_penalty", self.repetition_penalty, lo=0.0, hi=1e6, lo_open=True
        )
        if self.seed is not None:
            self.seed = _int("seed", self.seed, lo=_SEED_MIN, hi=_SEED_MAX)
        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = _token_ids("stop_token_ids", self.stop_token_ids)
        if self.max_tokens is not None:
            self.max_tokens = _int(
                "max_tokens", self.max_tokens, lo=1, hi=MAX_TOKENS,
                hint=f"1..{MAX_TOKENS}, or None for no limit"
            )
        self.min_tokens = _int("min_tokens", self.min_tokens, lo=0, hi=MAX_TOKENS)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
                param="min_tokens",
            )
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _bool(name, getattr(self, name))
        # -1: every token of the vocabulary (vLLM's meaning)
        if self.logprobs is not None:
            self.logprobs = _int(
                "logprobs", self.logprobs, lo=-1, hi=MAX_LOGPROBS, hint=f"None, -1 or 0..{MAX_LOGPROBS}"
            )
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _int("prompt_logprobs", self.prompt_logprobs, lo=-1, hi=MAX_LOGPROBS,
                                        hint=f"None, -1 or 0..{MAX_LOGPROBS}")
        if self.logprob_token_ids is not None:  # these tokens' logprobs at each position, whatever their rank
            self.logprob_token_ids = _token_ids("logprob_token_ids", self.logprob_token_ids)

        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            raise _fail("structured_outputs", self.structured_outputs,
                        "StructuredOutputsParams, a dict, or None")
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise _fail("allowed_token_ids", self.allowed_token_ids,
                            "a non-empty list of token ids, or None")
        if self.reasoning_budget is not None and not isinstance(self.reasoning_budget, ReasoningBudget):
            raise _fail("reasoning_budget", self.reasoning_budget, "a ReasoningBudget, or None")
        if self.whisper_rules is not None and not isinstance(self.whisper_rules, WhisperRules):
            raise _fail("whisper_rules", self.whisper_rules, "a WhisperRules, or None")

    @property
    def greedy(self) -> bool:
        """Temperature 0 (or close enough that sampling would be argmax anyway)."""
        return self.temperature < SAMPLING_EPS

    def replace(self, **changes: Any) -> SamplingParams:
        """A validated copy with ``changes`` applied (e.g. ``params.replace(n=1, seed=s + i)``)."""
        return dataclasses.replace(self.clone(), **changes)

    def clone(self) -> SamplingParams:
        """A deep copy: the lists are not shared with the original."""
        return copy.deepcopy(self)


# ----- validators: each returns the normalized value or raises naming field, value and range ------
def _fail(name: str, value: Any, allowed: str) -> SamplingParamsError:
    return SamplingParamsError(f"{name} must be {allowed}, got {value!r}", param=name)


def _int(name: str, value: Any, *, lo: int | None = None, hi: int | None = None, hint: str = "") -> int:
    allowed = hint or _range_text(lo, hi, "an integer")
    # bool is an int subclass; True as "n" is a bug in the caller, not a request for one sample.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _fail(name, value, allowed)
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise _fail(name, value, allowed)
    return value


def _float(
    name: str, value: Any, *, lo: float | None = None, hi: float | None = None, lo_open: bool = False
) -> float:
    allowed = _range_text(lo, hi, "a finite number", lo_open=lo_open)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(name, value, allowed)
    value = float(value)
    if not math.isfinite(value):
        raise _fail(name, value, allowed)
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise _fail(name, value, allowed)
    if hi is not None and value > hi:
        raise _fail(name, value, allowed)
    return value


def _bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise _fail(name, value, "True or False")


def _range_text(lo: float | None, hi: float | None, kind: str, *, lo_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f"{kind} in {'(' if lo_open else '['}{lo}, {hi}]"
    if lo is not None:
        return f"{kind} {'>' if lo_open else '>='} {lo}"
    if hi is not None:
        return f"{kind} <= {hi}"
    return kind


def _stop_strings(stop: Any) -> list[str]:
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
        raise _fail("stop", stop, "a string, a list of strings, or None")
    if len(items) > MAX_STOP_STRINGS:
        raise _fail("stop", f"<{len(items)} strings>", f"at most {MAX_STOP_STRINGS} stop strings")
    if any(s == "" for s in items):
        raise _fail("stop", stop, "non-empty strings (an empty stop string would end every request at once)")
    return list(items)


def _token_ids(name: str, ids: Any) -> list[int]:
    if ids is None:
        return []
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise _fail(name, ids, "a list of token ids >= 0, or None")
    out = list(ids)
    for t in out:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= int(t) <= MAX_TOKEN_ID:
            raise _fail(name, ids, f"a list of token ids in [0, {MAX_TOKEN_ID}], or None")
    return [int(t) for t in out]


def _logit_bias(bias: Any) -> dict[int, float] | None:
    if bias is None:
        return None
    allowed = f"a mapping of token id (>= 0) to a number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise _fail("logit_bias", bias, allowed)
    out: dict[int, float] = {}
    for k, v in bias.items():
        if isinstance(k, str) and k.strip().isdigit():
            k = int(k)
        tid = _int("logit_bias", k, lo=0, hi=MAX_TOKEN_ID, hint=allowed + f" (bad token id {k!r})")
        out[tid] = _float("logit_bias", v, lo=-MAX_LOGIT_BIAS, hi=MAX_LOGIT_BIAS)
    return out or None
