"""Engine outputs as OpenAI response objects: per-response state, completion / chat chunks, usage and
logprobs.

``serving.py`` drives requests; this module only formats what they produced.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from forwardpass.engine.frontend.outputs import CompletionOutput, Logprob, RequestOutput
from forwardpass.server.chat_output import ChatOutputParser

if TYPE_CHECKING:
    from forwardpass.loader.tokenizer import Tokenizer

#: One choice's logprobs as the engine gives them: per generated token, ``{token_id: Logprob}``.
LogprobEntries = Sequence[dict[int, Logprob]]

class ResponseContext:
    """Per-response constants and what has been sent per choice."""

    def __init__(self, rid: str, model: str, created: int, n: int, tokenizer: Tokenizer | None,
                 top_k: int = 0, parser: Callable[[], ChatOutputParser] = ChatOutputParser,
                 as_ids: bool = False, echo: str = "") -> None:
        self.rid, self.model, self.created, self.n = rid, model, created, n
        self.tokenizer, self.top_k = tokenizer, top_k
        self.as_ids, self.echo = as_ids, echo
        self.continuous_usage = False
        self.pinned: frozenset[int] | None = None  # vLLM's logprob_token_ids: the top entries shown
        self.prompt_tokens = 0  # streams: the prompts' tokens, for usage before the first output
        self.return_token_ids = False  # vLLM's return_token_ids: prompt_token_ids and token_ids too
        self.prompt_ids_sent = False  # chat streams: prompt_token_ids go on the first chunk only
        self.count_reasoning: Callable[[list[int]], int] | None = None  # chat with a reasoning parser
        self.echo_logprobs = False  # completions with echo and logprobs: the prompt's entries come first
        self.show_prompt_logprobs = False  # the request asked for prompt_logprobs (vLLM's field)
        self.prompt_top_k = 0  # prompt_logprobs: the most likely tokens shown per position
        self.echo_prompts: list[str] = []  # completions with echo: each prompt's text
        self.skipped = tokenizer.skipped_special_ids if tokenizer is not None else frozenset()
        self.sent_text: dict[int, int] = {}
        self.make_parser = parser
        self.parsers: dict[int, ChatOutputParser] = {}  # per chat choice: reasoning and tool-call parsing

    def parser(self, idx: int) -> ChatOutputParser:
        if idx not in self.parsers:
            self.parsers[idx] = self.make_parser()
        return self.parsers[idx]

    def chunk(self, obj: str, choices: list[dict[str, Any]], include_usage: bool) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                             "choices": choices, "system_fingerprint": None}
        if include_usage:
            d["usage"] = None
        return d

    @staticmethod
    def sse(d: dict[str, Any]) -> str:
        return f"data: {json.dumps(d, ensure_ascii=False)}\n\n"

    def prompt_logprobs_field(self, out: RequestOutput) -> dict[str, Any]:
        """vLLM's ``prompt_logprobs``: None for the first token, then ``{token id: {logprob, rank,
        decoded_token}}`` per prompt token — on the output that carries them."""
        if not self.show_prompt_logprobs or out.prompt_logprobs is None:
            return {}
        k = self.prompt_top_k  # the prompt's token and its k most likely (the engine may give more)
        return {"prompt_logprobs": [
            None if d is None else {
                str(t): {"logprob": v.logprob, "rank": v.rank, "decoded_token": v.decoded_token}
                for i, (t, v) in enumerate(d.items()) if i == 0 or (v.rank or 0) <= k}
            for d in out.prompt_logprobs]}

    def prompt_fields(self, out: RequestOutput) -> dict[str, Any]:
        """What a response says about the prompt: ``prompt_logprobs``, and ``prompt_token_ids`` (vLLM's
        ``return_token_ids``)."""
        d = self.prompt_logprobs_field(out)
        if self.return_token_ids:
            d["prompt_token_ids"] = list(out.prompt_token_ids)
        return d

    def token_ids(self, c: CompletionOutput) -> dict[str, Any]:
        return {"token_ids": list(c.token_ids)} if self.return_token_ids else {}

    def prompt_part(self, out: RequestOutput) -> dict[str, Any]:
        """The prompt's tokens in a completion's ``logprobs`` (echo): the first has no logprob."""
        first, rest = out.prompt_token_ids[0], out.prompt_logprobs or [None]
        text = "" if self.tokenizer is None else self.tokenizer.decode([first], skip_special_tokens=False)
        head = {"tokens": [f"token_id:{first}" if self.as_ids else text], "token_logprobs": [None],
                "top_logprobs": [None], "text_offset": [0]}
        offset = 0 if first in self.skipped else len(text)
        entries = [d for d in rest[1:] if d is not None]
        return joined(head, completion_logprobs(entries, offset, self.top_k, self.as_ids, self.skipped,
                                                self.pinned))

    def deltas(self, idx: int, c: CompletionOutput) -> tuple[str, list[dict[int, Logprob]] | None, int, int]:
        """(new text, new logprob entries, text offset, new token count) of choice
        ``idx``; ``c`` is a delta."""
        t0 = self.sent_text.get(idx, 0)
        self.sent_text[idx] = t0 + len(c.text)
        return c.text, c.logprobs, t0, len(c.token_ids)


def completion_chunks(ctx: ResponseContext, i: int, out: RequestOutput) -> Iterator[dict[str, Any]]:
    for c in out.outputs:
        idx = i * ctx.n + c.index
        first = idx not in ctx.sent_text
        text, lps, offset, new = ctx.deltas(idx, c)
        echo = ctx.echo_prompts[i] if first and ctx.echo_prompts else ""
        if new or text or c.finish_reason:  # one chunk per step that made tokens, even with no text yet
            logprobs = completion_logprobs(lps, offset + len(echo), ctx.top_k, ctx.as_ids, ctx.skipped,
                                           ctx.pinned) if lps is not None else None
            if first and logprobs is not None and ctx.echo_logprobs:
                logprobs = joined(ctx.prompt_part(out), logprobs)
            yield {"index": idx, "text": echo + text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                   "stop_reason": c.stop_reason, **(ctx.prompt_fields(out) if first else {}),
                   **ctx.token_ids(c)}


def chat_chunks(ctx: ResponseContext, i: int, out: RequestOutput) -> Iterator[dict[str, Any]]:
    for c in out.outputs:
        text, lps, _, new = ctx.deltas(c.index, c)
        lp = chat_logprobs(lps, ctx.top_k, ctx.as_ids, ctx.pinned) if lps else None
        parser = ctx.parser(c.index)
        delta = None
        if text or new or (c.finish_reason and not parser.plain):
            delta = parser.delta(text, final=c.finish_reason is not None)
        if c.finish_reason:  # as vLLM: the last chunk carries the last text with the finish reason
            yield {"index": c.index, "delta": delta or {}, "logprobs": lp,
                   "finish_reason": parser.finish_reason(c.finish_reason), "stop_reason": c.stop_reason,
                   **ctx.token_ids(c)}
        elif delta is not None or lp is not None or (ctx.return_token_ids and c.token_ids):
            yield {"index": c.index, "delta": delta or {}, "logprobs": lp, "finish_reason": None,
                   **ctx.token_ids(c)}


def merged(acc: RequestOutput, delta: RequestOutput) -> RequestOutput:
    """Fold a delta output into the accumulated one (the lists of an output are its
    own: extended in place)."""
    for a, d in zip(acc.outputs, delta.outputs):
        a.text += d.text
        a.token_ids.extend(d.token_ids)
        if a.logprobs is not None and d.logprobs is not None:
            a.logprobs.extend(d.logprobs)
        a.cumulative_logprob = d.cumulative_logprob
        a.finish_reason, a.stop_reason = d.finish_reason, d.stop_reason
    acc.finished, acc.metrics = delta.finished, delta.metrics
    acc.prompt_logprobs = acc.prompt_logprobs or delta.prompt_logprobs  # on one delta only
    return acc


def usage_of(outs: list[RequestOutput],
             count_reasoning: Callable[[list[int]], int] | None = None) -> dict[str, Any]:
    p = sum(len(o.prompt_token_ids) for o in outs)
    c = sum(len(x.token_ids) for o in outs for x in o.outputs)
    usage: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
    if count_reasoning is not None:  # OpenAI's shape: reasoning tokens are part of completion_tokens
        r = sum(count_reasoning(x.token_ids) for o in outs for x in o.outputs)
        usage["completion_tokens_details"] = {"reasoning_tokens": r}
    return usage


def _chosen_and_top(d: dict[int, Logprob], k: int, pinned: frozenset[int] | None = None,
                    ) -> tuple[tuple[int, Logprob], list[tuple[int, Logprob]]]:
    """The sampled token's (id, Logprob) (the dict's first entry) and the k best by rank — or, with
    ``pinned`` (vLLM's ``logprob_token_ids``), those tokens and the sampled one, most likely first."""
    chosen = next(iter(d.items()))
    if pinned is not None:
        return chosen, sorted(((t, v) for t, v in d.items() if t in pinned or t == chosen[0]),
                              key=lambda tv: -tv[1].logprob)
    ranked = [(v.rank, (t, v)) for t, v in d.items() if v.rank is not None and 1 <= v.rank <= k]
    ranked.sort(key=lambda rv: rv[0])
    return chosen, [tv for _, tv in ranked[:k]]


def _token_text(tid: int, v: Logprob, as_ids: bool) -> str:
    """The token as a response shows it: its text, or ``token_id:N`` (vLLM's
    ``return_tokens_as_token_ids``)."""
    return f"token_id:{tid}" if as_ids else (v.decoded_token or "")


def completion_logprobs(entries: LogprobEntries, offset: int, k: int, as_ids: bool = False,
                         skipped: frozenset[int] = frozenset(), pinned: frozenset[int] | None = None,
                         ) -> dict[str, Any]:
    """``skipped``: special tokens the text leaves out, so they do not move ``text_offset``. Each
    ``top_logprobs`` entry holds the ``k`` most likely tokens and the chosen one (so ``logprobs: 0`` still
    gives the chosen token's)."""
    tokens: list[str] = []
    lps: list[float] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for d in entries:
        (tid, chosen), top = _chosen_and_top(d, k, pinned)
        tok = _token_text(tid, chosen, as_ids)
        tokens.append(tok)
        lps.append(chosen.logprob)
        # as OpenAI and vLLM: the k most likely and the chosen token (k + 1 entries when it is not among
        # them); where two tokens read the same (partial UTF-8 bytes as "\ufffd"), the chosen one's shows
        # the chosen token first (vLLM's order: clients read it as the dict's first key)
        alternatives = {tok: chosen.logprob}
        for t, v in top:
            alternatives.setdefault(_token_text(t, v, as_ids), v.logprob)
        tops.append(alternatives)
        offsets.append(offset)
        offset += 0 if tid in skipped else len(chosen.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def joined(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {key: a[key] + b[key] for key in a}


def chat_logprobs(entries: LogprobEntries | None, k: int, as_ids: bool = False,
                  pinned: frozenset[int] | None = None) -> dict[str, Any]:
    def item(tid: int, v: Logprob) -> dict[str, Any]:
        tok = _token_text(tid, v, as_ids)
        return {"token": tok, "logprob": v.logprob, "bytes": list((v.decoded_token or "").encode("utf-8"))}

    content: list[dict[str, Any]] = []
    for d in entries or []:
        (tid, chosen), top = _chosen_and_top(d, k, pinned)
        content.append({**item(tid, chosen), "top_logprobs": [item(t, v) for t, v in top]})
    return {"content": content}
