"""Whisper's logit rules (``sampling/whisper_rules.py``), each on a small vocabulary: ids 0-9 text, 10 end of
text, 11-14 special, 15 ``<|notimestamps|>``, 16-29 timestamps."""

from __future__ import annotations

import pytest
import torch

from forwardpass import SamplingParams
from forwardpass.errors import SamplingParamsError
from forwardpass.sampling.sampler import Sampler, SamplingRow
from forwardpass.sampling.whisper_rules import WhisperRules

EOT, NO_TS, TS = 10, 15, 16
V = 30
RULES = WhisperRules(
    eot=EOT,
    suppress=(3, 12),
    suppress_begin=(1, EOT),
    timestamp_begin=TS,
    no_timestamps=NO_TS,
    max_initial_timestamp=4,
)


def allowed(rules: WhisperRules, output: list[int], logits: torch.Tensor | None = None) -> set[int]:
    x = torch.zeros(V) if logits is None else logits.clone()
    rules.apply(x, output)
    return {i for i in range(V) if x[i] > float("-inf")}


def test_suppressed_always_and_at_the_start():
    plain = WhisperRules(eot=EOT, suppress=(3, 12), suppress_begin=(1, EOT))
    assert allowed(plain, []) == set(range(V)) - {3, 12, 1, EOT}
    assert allowed(plain, [5]) == set(range(V)) - {3, 12}


def test_first_token_is_an_early_timestamp():
    assert allowed(RULES, []) == set(range(TS, TS + 5))


def test_timestamps_pair_and_never_go_back():
    text_likely = torch.zeros(V)
    text_likely[:TS] = (
        10.0  # text far likelier than the timestamps: the probability rule stays out of the way
    )
    text = set(range(EOT)) - {3}
    # text after <|t2|>: more text, the end, or a timestamp after t2 (not t2 itself: no empty segment)
    assert allowed(RULES, [TS + 2, 5], text_likely) == text | {EOT, 11, 13, 14} | set(range(TS + 3, V))
    # a timestamp that closes a segment: its partner (>= it) or the end, no text (the specials after the end
    # of text are left to the suppress list, as in CTranslate2)
    assert allowed(RULES, [TS, 5, TS + 4], text_likely) == {EOT, 11, 13, 14} | set(range(TS + 4, V))
    # a pair just closed: text or the end (and the other specials), no timestamp, however likely they are
    assert allowed(RULES, [TS, 5, TS + 4, TS + 4]) == set(range(TS)) - {3, 12, NO_TS}


def test_timestamps_win_when_together_likelier_than_any_text():
    x = torch.zeros(V)
    x[:EOT] = -1.0
    x[5] = 2.0  # the likeliest single token is text, but 14 timestamps at 0.0 outweigh it together
    assert allowed(RULES, [TS, 5], x) == set(range(TS + 1, V))
    x[5] = 5.0  # now text wins: both kinds stay allowed
    assert 5 in allowed(RULES, [TS, 5], x) and TS + 3 in allowed(RULES, [TS, 5], x)


def test_sampler_applies_rules_and_reports_the_filtered_logprob():
    logits = torch.zeros(1, V)
    logits[0, 3] = 9.0  # suppressed: never chosen
    logits[0, 7] = 1.0
    rules = WhisperRules(eot=EOT, suppress=(3,))
    row = SamplingRow(SamplingParams(temperature=0, whisper_rules=rules, logprobs=2), [0], [5])
    out = Sampler()(logits, [row])
    assert out.token_ids == [7]
    x = logits[0].clone()
    x[3] = float("-inf")
    assert out.logprobs[0].logprob == pytest.approx(float(torch.log_softmax(x, 0)[7]))
    assert (
        out.logprobs[0].top[0][0] == 3
    )  # the top tokens are the raw distribution's (no_speech_prob reads them)


def test_params_check_the_type():
    with pytest.raises(SamplingParamsError, match="whisper_rules"):
        SamplingParams(whisper_rules={"eot": 1})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timestamp_begin"):
        WhisperRules(eot=EOT, timestamp_begin=TS)
