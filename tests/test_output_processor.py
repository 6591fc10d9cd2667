"""The front end's OutputProcessor: stop strings wherever they fall in the token deltas, streamed text
equal to final text, logprob dicts, n > 1. No model: token deltas are fed in by hand."""

from __future__ import annotations

import pytest

from forwardpass.engine.frontend.output_processor import OutputProcessor
from forwardpass.engine.scheduling.batch import TokenDelta
from forwardpass.loader.tokenizer import Tokenizer
from forwardpass.sampling.params import SamplingParams
from forwardpass.sampling.sampler import TokenLogprobs
from tests.helpers.tokenizer_factory import make_test_tokenizer

TEXT = "the old clock said STOP then a long tail of words that goes on well past the stop string"
STOP = "STOP"


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(make_test_tokenizer(tmp_path_factory.mktemp("tok"), "bytelevel", 512))


def run(tok, ids, parts, params, finish_last=True):
    """Feed ``ids`` as deltas of the given sizes; return (final output, streamed text, stopped samples)."""
    proc = OutputProcessor(tok)
    state = proc.add_request("r", None, [1, 2], params)
    cursor = [(0, 0)]
    streamed, stopped, start = "", [], 0
    for i, n in enumerate(parts):
        last = i == len(parts) - 1
        delta = TokenDelta(
            "r",
            0,
            tuple(ids[start : start + n]),
            None,
            finish_reason="length" if last and finish_last else None,
        )
        start += n
        _, stop = proc.process([delta])
        stopped += stop
        streamed += state.make_output(cursor).outputs[0].text
        if state.finished:
            break
    return state.make_output().outputs[0], streamed, stopped


def test_stop_string_inside_one_long_delta(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    out, streamed, stopped = run(tok, ids, [len(ids)], SamplingParams(stop=[STOP]))
    assert out.text == TEXT[: TEXT.index(STOP)] and streamed == out.text
    assert out.finish_reason == "stop" and out.stop_reason == STOP
    assert stopped == []  # the delta itself said "length": the core has already finished the sample


def test_stop_string_found_for_every_split_of_the_deltas(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    spanning = 0
    for k in range(1, len(ids)):
        head = tok.decode(ids[:k])
        if STOP not in head and any(head.endswith(STOP[:j]) for j in range(1, len(STOP))):
            spanning += 1  # this split cuts the stop string in two deltas
        out, streamed, stopped = run(
            tok, ids, [k, len(ids) - k], SamplingParams(stop=[STOP]), finish_last=False
        )
        assert out.text == TEXT[: TEXT.index(STOP)] == streamed, k
        assert out.finish_reason == "stop" and out.stop_reason == STOP
        assert stopped == [("r", 0)]  # the core must be told to stop computing this sample
    assert spanning > 0


def test_one_token_per_delta_and_include_stop_str(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    for include in (False, True):
        params = SamplingParams(stop=[STOP], include_stop_str_in_output=include)
        out, streamed, _ = run(tok, ids, [1] * len(ids), params, finish_last=False)
        end = TEXT.index(STOP) + (len(STOP) if include else 0)
        assert out.text == TEXT[:end] == streamed


def test_stop_string_at_the_very_start(tok):
    text = STOP + " and more"
    ids = tok.encode(text, add_special_tokens=False)
    for include in (False, True):
        params = SamplingParams(stop=[STOP], include_stop_str_in_output=include)
        out, streamed, _ = run(tok, ids, [len(ids)], params, finish_last=False)
        assert out.text == (STOP if include else "") == streamed
        assert out.finish_reason == "stop"


def test_earliest_of_several_stop_strings_wins(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    out, _, _ = run(tok, ids, [3, len(ids) - 3], SamplingParams(stop=["tail", "clock"]), finish_last=False)
    assert out.text == "the old " and out.stop_reason == "clock"


def test_no_stop_before_min_tokens(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    before = len(tok.encode(TEXT[: TEXT.index(STOP) + len(STOP)], add_special_tokens=False))
    out, _, _ = run(
        tok, ids, [1] * len(ids), SamplingParams(stop=[STOP], min_tokens=before + 2, max_tokens=None)
    )
    assert out.finish_reason == "length" and out.text == TEXT


def test_visible_text_never_shrinks_and_holds_back_a_possible_stop(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    proc = OutputProcessor(tok)
    state = proc.add_request("r", None, [1], SamplingParams(stop=["words!"]))
    seen = ""
    for t in ids:
        proc.process([TokenDelta("r", 0, (t,), None)])
        text = state.make_output().outputs[0].text
        assert text.startswith(seen)
        assert len(state.samples[0].text) - len(text) <= len("words!") - 1
        seen = text


def test_logprobs_and_n_samples():
    proc = OutputProcessor(None)
    state = proc.add_request("r", None, [1], SamplingParams(n=2, logprobs=1))
    lp = TokenLogprobs(token_id=7, logprob=-0.5, rank=2, top=[(3, -0.1)])
    touched, _ = proc.process([TokenDelta("r", 1, (7,), (lp,), finish_reason="length")])
    assert touched == [state] and not state.finished
    out = state.make_output()
    assert [c.token_ids for c in out.outputs] == [[], [7]]
    assert [list(d) for d in out.outputs[1].logprobs] == [
        [7, 3]
    ]  # the sampled token first, then the top ones
    assert out.outputs[1].logprobs[0][7].rank == 2 and out.outputs[1].logprobs[0][3].rank == 1
    assert out.outputs[1].cumulative_logprob == -0.5
    proc.process([TokenDelta("r", 0, (9,), (lp,), finish_reason="stop", stop_reason=9)])
    assert state.finished and "r" not in proc.requests
