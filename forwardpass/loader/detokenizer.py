"""Streaming detokenization: token ids in, text deltas out, in O(1) work per token.

Decoding is not per-token: a byte-level BPE token can hold half of a UTF-8 character, and
SentencePiece-style decoders drop the leading space of the first token. So each step decodes a short
*window* of recent output tokens and emits only the part of its text that is final:

* text ending in U+FFFD is an incomplete character and is held back until the bytes arrive
  (like vLLM's ``detokenize_incrementally`` and HF's ``TextStreamer``);
* the window start moves forward only to a token that decodes on its own to a suffix of the
  window's text (so it begins a character and no context is lost), keeping the window short.

The window covers output tokens only, not the prompt, so that at the end ``text`` is exactly
``tokenizer.decode(output_ids)`` — e.g. a Llama first token "▁Hello" gives "Hello", as HF does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from forwardpass.loader.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Window length kept after a move; a UTF-8 character spans at most 4 byte tokens, so 6 leaves slack.
_WINDOW = 6


class _SpaceCleanupStream:
    """Apply HF's ``clean_up_tokenization`` (" ." -> ".", " n't" -> "n't", ...) to a stream.

    Every pattern starts with a space and is at most 4 characters long, so cleaning the text in two
    pieces gives the same result as cleaning it whole whenever the 3 characters before the cut hold
    no space. Text after the last such cut is held back until more arrives (or flush).
    """

    def __init__(self, clean: Callable[[str], str]):
        self._clean = clean
        self._pending = ""
        self._context = ""  # the last (<= 3) raw characters already passed on; never contains a space

    def push(self, raw: str) -> str:
        self._pending += raw
        stream = self._context + self._pending
        offset = len(self._context)
        cut = len(self._pending)
        while cut > 0 and " " in stream[max(0, offset + cut - 3) : offset + cut]:
            cut -= 1
        if cut == 0:
            return ""
        done, self._pending = self._pending[:cut], self._pending[cut:]
        self._context = (self._context + done)[-3:]
        return self._clean(done)

    def flush(self) -> str:
        done, self._pending, self._context = self._pending, "", ""
        return self._clean(done)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas for streaming.

    ``prompt_token_ids`` is accepted for API parity with vLLM but not used as decoding context: the
    contract is that ``text`` equals ``tokenizer.decode(output_ids)``, which has no prompt context.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.prompt_token_ids = list(prompt_token_ids)
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._start = 0  # first token of the decode window
        self._emitted = 0  # characters of decode(token_ids[_start:]) already emitted (before cleanup)
        self._byte_ids = tokenizer.byte_fallback_ids  # None unless the model uses byte fallback
        self._special_ids = tokenizer.skipped_special_ids
        self._cleanup = _SpaceCleanupStream(tokenizer.clean_up_spaces) if tokenizer.cleans_up_spaces else None

    def _is_byte(self, token_id: int) -> bool:
        return self._byte_ids is not None and token_id in self._byte_ids

    def _in_byte_run(self, token_id: int) -> bool:
        """A byte token, or a special token that decoding drops (so bytes on both sides join)."""
        return self._is_byte(token_id) or (self.skip_special_tokens and token_id in self._special_ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode_raw(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text it finalized (often "", never a partial char)."""
        self.token_ids.append(token_id)
        window = self._decode(self.token_ids[self._start :])
        stable = len(window.rstrip(_REPLACEMENT))
        if self._byte_ids is not None:
            # ByteFallback decodes a run of <0xNN> tokens as one group and turns the *whole* run into
            # U+FFFDs if it is invalid UTF-8, so the run's text is final only once the run ends.
            run = len(self.token_ids)
            while run > self._start and self._in_byte_run(self.token_ids[run - 1]):
                run -= 1
            if any(self._is_byte(t) for t in self.token_ids[run:]):
                head = self._decode(self.token_ids[self._start : run])
                stable = min(stable, len(head.rstrip(_REPLACEMENT)))
        delta = window[self._emitted : stable] if stable > self._emitted else ""
        self._emitted = max(self._emitted, stable)
        self._slide(window)
        return self._out(delta)

    def _slide(self, window: str) -> None:
        """Move the window start to ``len - _WINDOW`` if that token starts a clean suffix of the text."""
        n = len(self.token_ids)
        if n - self._start <= 2 * _WINDOW:
            return
        start = n - _WINDOW
        if self._byte_ids is not None and self._in_byte_run(self.token_ids[start]):
            return  # never start inside a run of byte-fallback tokens (decoded as one group)
        tail = self._decode(self.token_ids[start:])
        # A non-empty tail keeps the first surviving token (whose leading space a decoder may strip)
        # inside the window; a tail starting with U+FFFD begins mid-character.
        if not tail or tail.startswith(_REPLACEMENT) or not window.endswith(tail):
            return
        cut = len(window) - len(tail)
        if self._emitted >= cut:
            self._start, self._emitted = start, self._emitted - cut

    def _out(self, delta: str) -> str:
        if self._cleanup is not None:
            delta = self._cleanup.push(delta)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (e.g. a trailing incomplete character) at the end of generation."""
        window = self._decode(self.token_ids[self._start :])
        delta = window[self._emitted :]
        self._emitted = len(window)
        delta = self._out(delta)
        if self._cleanup is not None:
            rest = self._cleanup.flush()
            self.text += rest
            delta += rest
        return delta
