"""The engine side of structured output: grammars compiled once per constraint, one matcher per sequence.

``GrammarBackend`` is made by the engine builder and handed to the ``ModelRunner``'s constructor. It
reads the tokenizer (its vocabulary as xgrammar's ``TokenizerInfo``) on first use, so an engine whose
requests never ask for structured output pays nothing. Compiled grammars are kept in an LRU cache keyed
by the constraint's canonical text.

``GrammarState`` is one sequence's matcher. It is advanced by catching up with the sequence's output
tokens just before the next mask is built (``bitmask_row``), so whatever happened in between (several
tokens, a preemption that recomputed the prompt, chunked prefill that sampled nothing) it always
matches exactly the tokens generated so far. ``n > 1`` samples each get their own state.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from forwardpass.structured.params import StructuredOutputsParams, json_whitespace


class GrammarState:
    """One sequence's xgrammar matcher and how many of its output tokens it has accepted."""

    def __init__(self, matcher: Any, eos_token_ids: Sequence[int],
                 reasoning_end: Sequence[int] | None = None) -> None:
        self.matcher = matcher
        self.num_accepted = 0
        self.eos_token_ids = list(eos_token_ids)
        self.reasoning_end = list(reasoning_end) if reasoning_end else None  # None: the grammar applies now

    @property
    def active(self) -> bool:
        """False while the output is still reasoning (before the reasoning-end tokens): no mask yet."""
        return self.reasoning_end is None

    def advance(self, output: Sequence[int]) -> None:
        """Accept the output tokens not yet accepted; a token the grammar refuses raises."""
        if self.reasoning_end is not None:
            end = self.reasoning_end
            k = len(end)
            for i in range(max(0, self.num_accepted - k + 1), len(output) - k + 1):
                if list(output[i:i + k]) == end:  # reasoning ended: the answer starts after these tokens
                    self.reasoning_end, self.num_accepted = None, i + k
                    break
            else:
                self.num_accepted = len(output)
                return
        for t in output[self.num_accepted:]:
            if self.matcher.is_terminated():  # e.g. EOS ignored (ignore_eos): nothing more to match
                break
            if not self.matcher.accept_token(int(t)):
                raise ValueError(f"token {t} does not continue the requested structured output")
        self.num_accepted = len(output)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 words, bit i of
        word w = token 32w+i)."""
        if self.matcher.is_terminated():  # the structure is complete: only a stop token may follow
            bitmask[row].zero_()
            for t in self.eos_token_ids:
                bitmask[row, t // 32] |= _bit(t % 32)
            return
        self.matcher.fill_next_token_bitmask(bitmask, row)


def _bit(i: int) -> int:
    """Bit ``i`` of an int32 word, as a Python int torch accepts for int32 (bit 31 is negative)."""
    return (1 << i) if i < 31 else -(1 << 31)


class GrammarBackend:
    """Compiles constraints against the model's tokenizer (cached) and makes per-sequence states."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = 256, max_threads: int = 2) -> None:
        self.model_dir, self.vocab_size = Path(model_dir), vocab_size
        self.eos_token_ids = [t for t in eos_token_ids if t < vocab_size]
        self.cache_size, self.max_threads = cache_size, max_threads
        self._compiler: Any = None
        self._cache: OrderedDict[tuple[str, str, bool], Any] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def words(self) -> int:
        return (self.vocab_size + 31) // 32

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            from forwardpass.loader.tokenizer import Tokenizer

            tok = Tokenizer.from_dir(self.model_dir)
            encoded: list[str] = [""] * tok.vocab_size
            for token, i in tok.backend.get_vocab(with_added_tokens=True).items():
                encoded[i] = token
            text = tok.backend.to_str()
            metadata = xgr.TokenizerInfo._detect_metadata_from_hf(text)
            info = xgr.TokenizerInfo(
                encoded,
                vocab_type=metadata["vocab_type"] if not isinstance(metadata["vocab_type"], int)
                else xgr.VocabType(metadata["vocab_type"]),
                vocab_size=self.vocab_size,
                stop_token_ids=self.eos_token_ids,
                add_prefix_space=metadata["add_prefix_space"],
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads, cache_enabled=False)
        return self._compiler

    def compile(self, p: StructuredOutputsParams) -> Any:
        key = (*p.key, p.disable_any_whitespace)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            c = self._get_compiler()
            kind, text = p.key
            if kind in ("json", "json_object"):
                compiled = c.compile_json_schema(text, **json_whitespace(p))
            elif kind == "regex":
                compiled = c.compile_regex(text)
            elif kind == "structural_tag":
                compiled = c.compile_structural_tag(text)
            else:  # grammar, choice
                compiled = c.compile_grammar(text)
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return compiled

    def new_state(self, p: StructuredOutputsParams) -> GrammarState:
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(self.compile(p)), self.eos_token_ids, p.reasoning_end)

    def prepare(
        self, items: Sequence[tuple[StructuredOutputsParams | None, GrammarState | None, Sequence[int]]]
    ) -> tuple[list[GrammarState | None], list[torch.Tensor | None], dict[int, str]]:
        """For each sampled sequence (its constraint, its state so far, its output tokens): its state
        (made on first use), its mask row (``None`` for a free sequence) and the rows that failed
        (a grammar that does not compile, a token it refuses): only those requests fail."""
        states: list[GrammarState | None] = [None] * len(items)
        rows: list[torch.Tensor | None] = [None] * len(items)
        failed: dict[int, str] = {}
        bitmask = torch.full((len(items), self.words), -1, dtype=torch.int32)
        for i, (params, state, output) in enumerate(items):
            if params is None:
                continue
            try:
                state = state if state is not None else self.new_state(params)
                states[i] = state
                state.advance(output)
                if not state.active:
                    continue  # still reasoning: free
                state.fill(bitmask, i)
            except Exception as exc:  # noqa: BLE001 - fails this sequence's request only
                failed[i] = f"structured output failed for this request: {type(exc).__name__}: {exc}"
                continue
            rows[i] = bitmask[i]
        return states, rows, failed
