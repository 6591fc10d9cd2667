"""Whisper's decoding rules: the logit filters openai-whisper and faster-whisper apply at every step.

* ``suppress``: tokens never emitted (the checkpoint's non-speech symbols and the task / start tokens);
* ``suppress_begin``: tokens not emitted first (a blank, end of text: an empty transcript);
* with ``timestamps``: ``<|notimestamps|>`` never; the first token is a timestamp no later than
  ``max_initial_timestamp``; timestamps come in pairs (after one timestamp that follows text, another
  timestamp or the end; after two, text); they never go back in time; and when the timestamps together are
  more likely than the likeliest text token, a timestamp it is.

Like ``ReasoningBudget``, the rules hold no state: what they mask is read from the request's output tokens, so
preemption by recompute, ``n > 1`` and temperature fallback need no bookkeeping. The sampler applies them
after its other filters; a row with rules reports its chosen token's logprob under the filtered distribution
(what Whisper's ``avg_logprob`` threshold reads) and its top tokens under the raw one (what ``no_speech_prob``
reads).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WhisperRules:
    eot: int  # <|endoftext|>: the first id that is not text
    suppress: tuple[int, ...] = ()
    suppress_begin: tuple[int, ...] = ()
    #: None: the prompt ended with <|notimestamps|>, no timestamp rules. Else the first timestamp id
    #: (<|0.00|>)
    timestamp_begin: int | None = None
    no_timestamps: int | None = None
    max_initial_timestamp: int | None = (
        None  # in timestamp steps (0.02 s) from timestamp_begin; None: no limit
    )

    def __post_init__(self) -> None:
        if self.timestamp_begin is not None and (
            self.no_timestamps is None or self.timestamp_begin <= self.eot
        ):
            raise ValueError("whisper rules with timestamps need no_timestamps and timestamp_begin > eot")

    def apply(self, logits: torch.Tensor, output: Sequence[int]) -> None:
        """Mask (to -inf) what the rules forbid in ``logits`` ``[V]`` (one row), given the output so far."""
        neg = float("-inf")
        vocab = logits.shape[0]
        if self.suppress:
            logits.index_fill_(0, _ids(self.suppress, vocab), neg)
        step = len(output)
        if step == 0 and self.suppress_begin:
            logits.index_fill_(0, _ids(self.suppress_begin, vocab), neg)
        ts = self.timestamp_begin
        if ts is None or ts >= vocab:
            return
        assert self.no_timestamps is not None
        logits[self.no_timestamps] = neg
        if step == 0:
            logits[:ts] = neg  # the transcript opens with a timestamp
            if self.max_initial_timestamp is not None:
                logits[ts + self.max_initial_timestamp + 1 :] = neg
            return
        last = output[-1]
        check_probability = True
        if last >= ts:
            penultimate = output[-2] if step > 1 else last
            if penultimate >= ts:  # a pair just closed: text (or the end) next
                logits[ts:] = neg
                check_probability = False
            else:  # a segment's closing timestamp: its pair partner or the end, and no earlier time
                logits[: self.eot] = neg
                logits[ts:last] = neg
        else:
            for token in reversed(output):  # timestamps never go back in time
                if token >= ts:
                    logits[ts : token + 1] = neg
                    break
        if check_probability:
            text_max = logits[:ts].max()
            if (
                torch.logsumexp(logits[ts:], 0) > text_max
            ):  # log-softmax's normaliser cancels in the comparison
                logits[:ts] = neg


_ID_CACHE: dict[tuple[tuple[int, ...], int], torch.Tensor] = {}


def _ids(ids: tuple[int, ...], vocab: int) -> torch.Tensor:
    """``ids`` below ``vocab`` as an index tensor, made once per list (the rules repeat every step)."""
    key = (ids, vocab)
    found = _ID_CACHE.get(key)
    if found is None:
        if len(_ID_CACHE) > 64:
            _ID_CACHE.clear()
        found = _ID_CACHE[key] = torch.tensor([i for i in ids if 0 <= i < vocab], dtype=torch.long)
    return found
