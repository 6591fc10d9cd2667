"""Reasoning parsers (``--reasoning-parser qwen3 | deepseek_r1``): ``<think>...</think>`` becomes
``reasoning_content``, the rest ``content`` — in whole responses and in streaming deltas, as vLLM does.

* ``deepseek_r1``: the output starts in reasoning (DeepSeek-R1's template opens ``<think>`` in the
  prompt); a leading ``<think>`` is dropped; everything up to ``</think>`` is reasoning. An output that
  never closes it is all reasoning.
* ``qwen3``: reasoning only if the output opens with ``<think>`` or closes one the template opened
  (``</think>`` appears); with ``enable_thinking=False`` the whole output is content.

``ReasoningSplitter`` is incremental: fed text deltas, it returns (reasoning, content) deltas, holding back
a tail that may be the start of a tag split across two deltas.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


def _partial_tag_tail(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningSplitter:
    def __init__(self, parser: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; choose one of {', '.join(PARSERS)}")
        self.parser = parser
        self.state = "start"  # start -> reasoning -> content (qwen3 may go start -> content)
        self.buf = ""
        self._after_end = False
        self.num_reasoning_chars = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """The (reasoning, content) text this delta completes; ``final`` flushes what was held back."""
        self.buf += delta
        reasoning = content = ""
        while True:
            if self.state == "start":
                stripped = self.buf.lstrip()
                if stripped.startswith(START):
                    self.buf, self.state = stripped[len(START):], "reasoning"
                    continue
                if START.startswith(stripped) and stripped and not final:
                    break  # maybe "<thi": wait for more
                if self.parser == "deepseek_r1":
                    self.state = "reasoning"
                    continue
                # qwen3: reasoning only if a template-opened block closes in the first delta
                self.state = "reasoning" if END in self.buf else "content"
                continue
            if self.state == "reasoning":
                i = self.buf.find(END)
                if i >= 0:
                    reasoning += self.buf[:i]
                    self.buf, self.state, self._after_end = self.buf[i + len(END):], "content", True
                    continue
                keep = 0 if final else _partial_tag_tail(self.buf, END)
                reasoning += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                break
            if self._after_end:  # the newlines a template puts after </think> are not content
                self.buf = self.buf.lstrip("\n")
                self._after_end = not self.buf
            content += self.buf
            self.buf = ""
            break
        self.num_reasoning_chars += len(reasoning)
        return reasoning, content


def split_reasoning(parser: str, text: str) -> tuple[str | None, str]:
    """Whole-response split: (reasoning_content or None, content)."""
    if parser == "qwen3" and END not in text and not text.lstrip().startswith(START):
        return None, text
    s = ReasoningSplitter(parser)
    reasoning, content = s.feed(text, final=True)
    return reasoning, content


def reasoning_token_count(parser: str, token_ids: list[int], start_ids: tuple[int, ...],
                          end_ids: tuple[int, ...]) -> int:
    """How many of an output's tokens are reasoning (``usage.completion_tokens_details.reasoning_tokens``):
    up to and including the closing tag; all of them if it never closes and the parser reads the output as
    reasoning (as :func:`split_reasoning` does)."""
    n = len(end_ids)
    for i in range(len(token_ids) - n + 1):
        if tuple(token_ids[i : i + n]) == end_ids:
            return i + n
    opened = tuple(token_ids[: len(start_ids)]) == start_ids
    return len(token_ids) if parser == "deepseek_r1" or opened else 0
