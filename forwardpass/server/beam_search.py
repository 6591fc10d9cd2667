"""vLLM's beam search for ``/v1/completions`` (``use_beam_search: true``), on top of the engine.

As vLLM does it online: each step asks the engine for one token of every live beam (its prompt plus the
beam's tokens, so the prefix cache holds the shared part) with the ``2 * n`` most likely next tokens and their
logprobs; every candidate scores its beam's summed logprob plus its own, the ``n`` best that are not an end
token live on, and each end-token candidate is set aside as finished. After ``max_tokens`` steps (or when no
beam is left) the finished and live beams are ranked by ``sum logprob / length ** length_penalty`` — the
length counting the prompt, as vLLM's score does — and the best ``n`` are the choices.

The candidates come from the raw distribution (the logprobs the engine reports), so ``temperature`` and the
other sampling fields (``stop``, ``min_tokens``, penalties) do not change them, as in vLLM. Requests that
cannot be answered that way (streaming, ``echo`` with ``logprobs``, ``prompt_logprobs``,
``logprob_token_ids``, more than ``MAX_WIDTH`` beams) are a 400 before any engine request (``asks_beams``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from forwardpass.engine.frontend.outputs import CompletionOutput, Logprob, RequestOutput
from forwardpass.errors import RequestAbortedError, ValidationError
from forwardpass.sampling.params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from forwardpass.engine.frontend.async_engine import AsyncLLMEngine
    from forwardpass.lora.request import LoRARequest
    from forwardpass.server.protocol import CompletionRequest

#: Most beams a request may ask for: each step lists 2 * n candidates per beam, within the engine's logprobs.
MAX_WIDTH = MAX_LOGPROBS // 2


@dataclass(frozen=True)
class BeamParams:
    width: int  # the request's n
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # an end token that finished a beam stays in its tokens
    skip_special_tokens: bool = True
    logprobs: bool = False  # each choice's logprobs (the response shows the request's logprobs of them)

    @classmethod
    def of(cls, req: CompletionRequest, max_tokens: int) -> BeamParams:
        return cls(req.n, max_tokens, req.length_penalty, req.ignore_eos, req.include_stop_str_in_output,
                   req.skip_special_tokens, req.logprobs is not None)


def asks_beams(req: CompletionRequest) -> bool:
    """Whether ``req`` asks for beam search; a 400 naming the field for what beam search cannot answer (as
    vLLM: streaming, echo with logprobs, logprob_token_ids; here also prompt_logprobs, which vLLM leaves
    null, and more than MAX_WIDTH beams, whose 2 * n candidates would pass the engine's logprobs limit)."""
    if not req.use_beam_search:
        return False
    for name, bad, why in (("stream", req.stream, "streaming"),
                           ("echo", req.echo and req.logprobs is not None, "echo with logprobs"),
                           ("logprob_token_ids", req.logprob_token_ids, "logprob_token_ids"),
                           ("prompt_logprobs", req.prompt_logprobs is not None, "prompt_logprobs"),
                           ("n", req.n > MAX_WIDTH, f"more than {MAX_WIDTH} beams (n)")):
        if bad:
            raise ValidationError(f"{why} is not supported with beam search (use_beam_search)", param=name)
    return True


@dataclass
class Beam:
    tokens: list[int]  # generated so far
    score: float = 0.0  # summed logprob
    # per step: the chosen token's entry first (the response formatter reads the first entry as chosen)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | None = None


def ranking_score(beam: Beam, prompt_len: int, length_penalty: float, eos: Collection[int]) -> float:
    """vLLM's ranking: summed logprob over length ** length_penalty; the length counts the prompt and leaves
    out a final end token (at least 1)."""
    length = prompt_len + len(beam.tokens) - (bool(beam.tokens) and beam.tokens[-1] in eos)
    return beam.score / (max(length, 1) ** length_penalty)


def extend(beams: list[Beam], steps: list[dict[int, Logprob]], width: int, eos: Collection[int],
           p: BeamParams, finished: list[Beam]) -> list[Beam]:
    """One step: ``steps[i]`` holds beam i's candidates. End-token candidates go to ``finished``; returns the
    ``width`` best other candidates as the new beams (best first)."""
    candidates: list[tuple[float, int, Beam, dict[int, Logprob]]] = []
    for beam, cands in zip(beams, steps):
        for tid, lp in cands.items():
            score = beam.score + lp.logprob
            if tid in eos and not p.ignore_eos:
                kept = beam.tokens + [tid] if p.include_stop_str_in_output else list(beam.tokens)
                finished.append(Beam(kept, score, beam.logprobs + [_chosen_first(cands, tid)], "stop", tid))
            else:
                candidates.append((score, tid, beam, cands))
    candidates.sort(key=lambda c: -c[0])  # stable: equal scores keep the engine's order
    return [Beam(beam.tokens + [tid], score, beam.logprobs + [_chosen_first(cands, tid)])
            for score, tid, beam, cands in candidates[:width]]


def best(beams: list[Beam], prompt_len: int, p: BeamParams, eos: Collection[int]) -> list[Beam]:
    ranked = sorted(beams, key=lambda b: ranking_score(b, prompt_len, p.length_penalty, eos), reverse=True)
    return ranked[:p.width]


def _chosen_first(cands: dict[int, Logprob], tid: int) -> dict[int, Logprob]:
    return {tid: cands[tid], **{t: v for t, v in cands.items() if t != tid}}


async def beam_search(engine: AsyncLLMEngine, prompt: list[int], p: BeamParams, request_id: str,
                      lora: LoRARequest | None, decode: Callable[[list[int], bool], Awaitable[str]],
                      ) -> RequestOutput:
    """The ``p.width`` best beams of ``prompt`` as one finished ``RequestOutput`` (choice i: beam i).
    ``decode(ids, skip_special_tokens)``: the text of a beam's tokens (off the event loop)."""
    eos = set(engine.info.eos_token_ids) if engine.info is not None else set()
    step = SamplingParams(n=1, temperature=0.0, max_tokens=1, logprobs=2 * p.width)
    beams: list[Beam] = [Beam([])]
    finished: list[Beam] = []
    for n in range(p.max_tokens):
        got = await asyncio.gather(*(_candidates(engine, prompt + b.tokens, step, f"{request_id}-{n}-{i}",
                                                 lora) for i, b in enumerate(beams)))
        beams = extend(beams, got, p.width, eos, p, finished)
        if not beams:
            break
    for b in beams:
        b.finish_reason = "length"
    outputs = []
    for i, b in enumerate(best(finished + beams, len(prompt), p, eos)):
        # a kept end token (include_stop_str_in_output) is in token_ids but not in the text, as vLLM
        shown = b.tokens[:-1] if b.finish_reason == "stop" and b.tokens and b.tokens[-1] in eos else b.tokens
        text = await decode(shown, p.skip_special_tokens)
        outputs.append(CompletionOutput(index=i, text=text, token_ids=b.tokens, cumulative_logprob=b.score,
                                        logprobs=b.logprobs if p.logprobs else None,
                                        finish_reason=b.finish_reason, stop_reason=b.stop_reason))
    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=prompt, outputs=outputs,
                         finished=True)


async def search_all(engine: AsyncLLMEngine, prompts: list[list[int]], params: list[BeamParams],
                     request_id: str, lora: LoRARequest | None,
                     decode: Callable[[list[int], bool], Awaitable[str]]) -> list[RequestOutput]:
    """Every prompt's beams at once (output i: prompt i); a failure, or cancelling this, stops them all."""
    tasks = [asyncio.ensure_future(beam_search(engine, ids, p, f"{request_id}-{i}", lora, decode))
             for i, (ids, p) in enumerate(zip(prompts, params))]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()  # no-op for the finished ones


async def _candidates(engine: AsyncLLMEngine, ids: list[int], step: SamplingParams, request_id: str,
                      lora: LoRARequest | None) -> dict[int, Logprob]:
    """The next token's candidates after ``ids``: its 2 * n most likely tokens and their logprobs."""
    stream = await engine.add_request(ids, step, request_id, lora)
    try:
        out = None
        async for last in stream:
            out = last
    finally:
        stream.close()  # aborts it if this step was cancelled (client gone)
    c = out.outputs[0] if out is not None else None
    if c is None or not c.logprobs:  # the engine answers a finished one-token request with its logprobs
        raise RequestAbortedError(f"beam search: step {request_id} ended without a token")
    return c.logprobs[0]
