"""A thinking budget: after ``max_tokens`` reasoning tokens the sampler forces the closing tag.

Reasoning models write ``<think> ... </think>`` before the answer; ``max_tokens`` covers both, so an
unbounded reasoning phase can use the whole budget and leave no answer. ``ReasoningBudget`` ends the
reasoning by forcing the closing tag's tokens (all other logits masked) once the budget is spent —
the model then answers as if it had closed the block itself.

The state is read from the tokens, not kept: reasoning is open when the prompt's generation prompt
opened it (DeepSeek-R1's template, Qwen3's thinking templates) or the output opened it, and it is
not closed yet. Stateless means preemption by recompute, ``n > 1`` and retries need no bookkeeping.
The forced tag tokens come after the budget: a request reasons for at most ``max_tokens`` tokens
plus the length of the closing tag.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: A generation prompt that opens reasoning ends with the opening tag (plus a newline or two), so only
#: this many of the prompt's last tokens are searched — not the whole prompt on every step.
_PROMPT_TAIL = 64


@dataclass(frozen=True)
class ReasoningBudget:
    max_tokens: int  # reasoning tokens allowed before the closing tag is forced (0: close at once)
    start_ids: tuple[int, ...]  # the opening tag's tokens, e.g. <think>
    end_ids: tuple[int, ...]  # the closing tag's tokens, e.g. </think>

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 0:
            raise ValueError(f"max_reasoning_tokens must be an integer >= 0, got {self.max_tokens!r}")
        if not self.start_ids or not self.end_ids:
            raise ValueError("a reasoning budget needs the opening and closing tags' token ids")

    def forced_token(self, prompt: Sequence[int], output: Sequence[int]) -> int | None:
        """The token the sampler must emit next, or None when the budget does not constrain it."""
        if _find(output, self.end_ids) >= 0:
            return None  # reasoning already closed
        opened = _rfind(output, self.start_ids)
        if opened >= 0:
            spent = len(output) - opened - len(self.start_ids)
        elif _opens(prompt[-_PROMPT_TAIL:], self.start_ids, self.end_ids):
            spent = len(output)
        else:
            return None  # not reasoning
        partial = _partial_suffix(output, self.end_ids)  # the closing tag, begun (by us or the model)
        if spent - partial >= self.max_tokens:
            return self.end_ids[partial]
        return None


def _find(seq: Sequence[int], sub: tuple[int, ...]) -> int:
    n = len(sub)
    for i in range(len(seq) - n + 1):
        if seq[i] == sub[0] and tuple(seq[i : i + n]) == sub:
            return i
    return -1


def _rfind(seq: Sequence[int], sub: tuple[int, ...]) -> int:
    n = len(sub)
    for i in range(len(seq) - n, -1, -1):
        if seq[i] == sub[0] and tuple(seq[i : i + n]) == sub:
            return i
    return -1


def _opens(tail: Sequence[int], start: tuple[int, ...], end: tuple[int, ...]) -> bool:
    """The prompt ends inside a reasoning block: its last opening tag comes after its last closing tag."""
    s = _rfind(tail, start)
    return s >= 0 and _rfind(tail, end) < s


def _partial_suffix(seq: Sequence[int], tag: tuple[int, ...]) -> int:
    """Length of the longest suffix of ``seq`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(seq)), 0, -1):
        if tuple(seq[len(seq) - k :]) == tag[:k]:
            return k
    return 0
