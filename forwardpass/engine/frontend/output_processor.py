"""From the engine core's ``TokenDelta``s to ``RequestOutput``s: detokenization, stop strings, logprobs, n.

This runs in the front end (``LLMEngine`` in the caller's thread, ``AsyncLLMEngine`` on the event
loop), next to the tokenizer; the engine core only counts tokens. Per request it keeps append-only
state: token ids, text, logprob dicts. An output is either the whole state so far (cumulative) or
what was added since a caller's cursor (delta), so nothing is copied more than once per consumer.

Stop strings: each sample remembers where its next search starts. A stop string that completes with
the newest text starts at most ``len(stop) - 1`` characters before it, so searching from
``old length - (longest stop - 1)`` finds every stop string, whatever the length of the new text. While
a sample runs, the last ``longest stop - 1`` characters are held back (they may turn out to start a
stop string), so visible text only ever grows and streamed text equals non-streamed text.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from forwardpass.engine.frontend.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from forwardpass.engine.scheduling.batch import TokenDelta
from forwardpass.loader.detokenizer import IncrementalDetokenizer
from forwardpass.loader.tokenizer import Tokenizer
from forwardpass.sampling.params import SamplingParams
from forwardpass.sampling.sampler import TokenLogprobs


@dataclass
class SampleState:
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    _stop_search_from: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def visible_text(self) -> str:
        """While running, hold back a tail that could still turn out to be the start of a stop string."""
        if self.finished or not self.params.stop:
            return self.text
        hold = max(len(s) for s in self.params.stop) - 1
        return self.text[: max(0, len(self.text) - hold)] if hold > 0 else self.text

    def add_text(self, new: str) -> None:
        self.text += new
        p = self.params
        if not p.stop:
            return
        longest = max(len(s) for s in p.stop)
        search_from, self._stop_search_from = self._stop_search_from, max(0, len(self.text) - (longest - 1))
        if len(self.token_ids) < p.min_tokens:  # no stop condition counts before min_tokens
            return
        best: tuple[int, str] | None = None
        for s in p.stop:
            idx = self.text.find(s, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is not None:
            idx, s = best
            self.text = self.text[: idx + len(s)] if p.include_stop_str_in_output else self.text[:idx]
            self.finish_reason, self.stop_reason = "stop", s


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[SampleState]
    metrics: RequestMetrics  # kept up to date by OutputProcessor.process; each output gets a copy
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # when asked, from the first token on
    prompt_logprobs_sent: bool = False  # streamed outputs (cursor) carry them once

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    def make_output(self, cursor: list[tuple[int, int]] | None = None) -> RequestOutput:
        """The request's output: cumulative, or (with ``cursor``) only what was added since the cursor
        — ``cursor[i]`` is (tokens, visible characters) of sample ``i`` already handed out; advanced."""
        completions = []
        for s in self.samples:
            text = s.visible_text()
            k, t = (0, 0) if cursor is None else cursor[s.index]
            if cursor is not None:
                cursor[s.index] = (len(s.token_ids), len(text))
            completions.append(
                CompletionOutput(
                    index=s.index,
                    text=text[t:],
                    token_ids=s.token_ids[k:],
                    cumulative_logprob=s.cumulative_logprob,
                    logprobs=None if s.logprobs is None else s.logprobs[k:],
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                )
            )
        prompt_lps = self.prompt_logprobs
        if cursor is not None:
            prompt_lps, self.prompt_logprobs_sent = (None if self.prompt_logprobs_sent else prompt_lps,
                                                     self.prompt_logprobs_sent or prompt_lps is not None)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,  # shared, never mutated
            outputs=completions,
            finished=self.finished,
            metrics=replace(self.metrics),
            num_cached_tokens=self.metrics.num_cached_tokens,
            prompt_logprobs=prompt_lps,
        )


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> RequestState:
        samples = []
        for i in range(params.n):
            detok = (
                IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
                if self.tokenizer is not None
                else None
            )
            samples.append(
                SampleState(i, params, detok, logprobs=[] if params.logprobs is not None else None)
            )
        state = RequestState(
            request_id,
            prompt,
            prompt_token_ids,
            samples,
            RequestMetrics(arrival_time if arrival_time is not None else time.monotonic()),
        )
        self.requests[request_id] = state
        return state

    def abort(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.requests.pop(rid, None)

    def process(self, deltas: Iterable[TokenDelta]) -> tuple[list[RequestState], list[tuple[str, int]]]:
        """Apply deltas. Returns the requests that advanced (finished ones are no longer tracked) and
        the samples a stop string just finished, which the engine core must stop computing."""
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        stopped: list[tuple[str, int]] = []
        for d in deltas:
            state = self.requests.get(d.request_id)
            if state is None:
                continue  # aborted meanwhile
            sample = state.samples[d.index]
            if sample.finished:
                continue  # a stop string ended it; the core computed a step ahead
            m = state.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            m.first_scheduled_time = d.first_scheduled_time
            m.num_cached_tokens = d.num_cached_tokens
            m.num_preemptions = max(m.num_preemptions, d.num_preemptions)
            m.num_draft_tokens += d.num_draft_tokens  # speculative decoding, summed over the n samples
            m.num_accepted_tokens += d.num_accepted_tokens
            self._append(sample, d)
            if d.prompt_logprobs is not None and state.prompt_logprobs is None:  # every sample has them
                state.prompt_logprobs = [None if lp is None else self._logprob_dict(lp)
                                         for lp in d.prompt_logprobs]
            if (
                sample.finish_reason == "stop"
                and isinstance(sample.stop_reason, str)
                and d.finish_reason is None
            ):
                stopped.append((d.request_id, d.index))
            touched[d.request_id] = state
        for rid, state in touched.items():
            if state.finished:
                state.metrics.finished_time = now
                del self.requests[rid]
        return list(touched.values()), stopped

    def _append(self, sample: SampleState, d: TokenDelta) -> None:
        if len(d.token_ids) > 1 and sample.params.stop:  # several tokens (speculative decoding): a stop
            for i in range(len(d.token_ids)):  # string may end the sample early; the later tokens then go
                last = i == len(d.token_ids) - 1
                self._append(sample, replace(d, token_ids=d.token_ids[i : i + 1],
                                             logprobs=None if d.logprobs is None else d.logprobs[i : i + 1],
                                             finish_reason=d.finish_reason if last else None,
                                             stop_reason=d.stop_reason if last else None))
                if sample.finished:
                    return
            return
        sample.token_ids.extend(d.token_ids)
        if d.logprobs is not None and sample.logprobs is not None:
            for lp in d.logprobs:
                sample.logprobs.append(self._logprob_dict(lp))
                sample.cumulative_logprob = (sample.cumulative_logprob or 0.0) + lp.logprob
        detok = sample.detokenizer
        new = "" if detok is None else "".join(detok.add(t) for t in d.token_ids)
        if d.finish_reason == "stop":  # EOS or a stop token: it wins over any stop string
            sample.text += new + (detok.flush() if detok is not None else "")
        else:
            sample.add_text(new)  # may finish the sample on a stop string
            if d.finish_reason is not None and not sample.finished:  # length
                sample.text += detok.flush() if detok is not None else ""
        if d.finish_reason is not None and not sample.finished:
            sample.finish_reason, sample.stop_reason = d.finish_reason, d.stop_reason

    def _logprob_dict(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        """vLLM-shaped logprobs of one position: the sampled token first, then the top ones by rank."""
        tok = self.tokenizer
        decode = (
            (lambda t: tok.decode([t], skip_special_tokens=False)) if tok is not None else (lambda t: None)
        )
        d = {lp.token_id: Logprob(lp.logprob, lp.rank, decode(lp.token_id))}
        for rank, (tid, val) in enumerate(lp.top, start=1):
            d.setdefault(tid, Logprob(val, rank, decode(tid)))
        for tid, val, rank in lp.pinned:  # logprob_token_ids
            d.setdefault(tid, Logprob(val, rank, decode(tid)))
        return d
