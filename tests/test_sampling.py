"""Sampling: parameter validation, the sampler's distributions, seeds, penalties, logprobs, min_tokens.

Distribution checks draw many samples at once by repeating one row in a batch, and compare counts to
the exact distribution with a chi-square test at a fixed seed.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from forwardpass.errors import SamplingParamsError
from forwardpass.sampling import SamplingParams
from forwardpass.sampling.sampler import (
    Sampler,
    SamplingRow,
    _draw_big_nucleus,
    _draw_big_nucleus_by_full_sort,
    make_generator,
)

N_DRAWS = 20_000
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


# ----- validation ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -2.1}, "presence_penalty"),
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
        ({"frequency_penalty": float("-inf")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"n": 0}, "n"),
        ({"n": True}, "n"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"seed": 1.5}, "seed"),
        ({"seed": True}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"logprobs": -2}, "logprobs"),  # -1 is the whole vocabulary (vLLM's meaning)
        ({"logprobs": 21}, "logprobs"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_invalid_values_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == field
    assert field in str(info.value)
    assert info.value.status_code == 400


def test_valid_values_are_normalized():
    p = SamplingParams(temperature=0, top_k=0, stop="###", stop_token_ids=(7, 8), seed=-3, max_tokens=None)
    assert p.greedy and p.top_k == -1 and p.stop == ["###"] and p.stop_token_ids == [7, 8]
    assert isinstance(p.temperature, float)
    assert SamplingParams().stop == [] and SamplingParams().stop_token_ids == []
    assert not SamplingParams(temperature=1e-3).greedy
    q = p.replace(n=3)
    assert q.n == 3 and p.n == 1
    q.stop.append("x")
    assert p.stop == ["###"]  # replace / clone do not share lists
    with pytest.raises(SamplingParamsError):
        p.replace(top_p=2.0)  # replace re-validates


# ----- helpers ------------------------------------------------------------------------------------
def rows_of(params, n, prompt=(), output=(), generator=None):
    return [SamplingRow(params, list(prompt), list(output), generator) for _ in range(n)]


def draw(logits_row, params, n=N_DRAWS, sampler=None, seed=0, device="cpu"):
    torch.manual_seed(seed)
    sampler = sampler or Sampler()
    logits = logits_row[None, :].repeat(n, 1).to(device)
    return np.array(sampler(logits, rows_of(params, n)).token_ids)


def kept_distribution(logits_row, p: SamplingParams) -> np.ndarray:
    """The exact distribution after temperature, min_p, top_k and top_p, from the definitions."""
    x = logits_row.double().numpy() / p.temperature
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    keep = probs >= p.min_p * probs.max()
    order = np.argsort(-probs, kind="stable")
    if p.top_k > 0:
        keep[order[p.top_k :]] = False
    q = np.where(keep, probs, 0.0)
    q /= q.sum()
    before = np.cumsum(q[order]) - q[order]  # mass of the more likely tokens
    keep[order[before >= p.top_p]] = False  # smallest set whose mass reaches top_p
    q = np.where(keep, q, 0.0)
    return q / q.sum()


def chi2_pvalue(tokens: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(tokens, minlength=len(probs)).astype(float)
    assert counts[probs == 0].sum() == 0, "drew a token outside the kept set"
    expected = probs * len(tokens)
    big = expected >= 5  # merge the rare tokens into one bin so the test is valid
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    if len(obs) < 2:
        return 1.0
    return float(stats.chisquare(obs, exp).pvalue)


@pytest.fixture
def logits32():
    return torch.randn(32, generator=torch.Generator().manual_seed(1)) * 2


# ----- distributions ------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5])
def test_temperature_matches_softmax(logits32, temperature, device):
    p = SamplingParams(temperature=temperature)
    assert chi2_pvalue(draw(logits32, p, device=device), kept_distribution(logits32, p)) > 1e-3


def test_two_level_draw_over_several_blocks():
    # Mass spread over blocks of a 3000-token vocab, including the short last block.
    logits = torch.full((3000,), -4.0)
    logits[[3, 700, 1024, 1500, 2047, 2048, 2999]] = torch.tensor([2.0, 1.0, 1.5, 0.5, 2.5, 0.0, 1.8])
    p = SamplingParams(temperature=1.0)
    probs = kept_distribution(logits, p)
    assert chi2_pvalue(draw(logits, p, n=8000, sampler=Sampler(block=1024)), probs) > 1e-3
    assert (
        chi2_pvalue(
            draw(logits[:50] * 0 + torch.arange(50) * 0.1, p, sampler=Sampler(block=8)),
            kept_distribution(torch.arange(50) * 0.1, p),
        )
        > 1e-3
    )


@pytest.mark.parametrize("k", [1, 5, 20])
def test_top_k_never_leaves_the_k_most_likely(logits32, k, device):
    p = SamplingParams(temperature=1.3, top_k=k)
    tokens = draw(logits32, p, device=device)
    allowed = set(torch.topk(logits32, k).indices.tolist())
    assert set(tokens.tolist()) <= allowed
    assert chi2_pvalue(tokens, kept_distribution(logits32, p)) > 1e-3


@pytest.mark.parametrize("candidates", [4, 256])  # 4: the nucleus overflows the candidates -> full sort
@pytest.mark.parametrize("top_p", [0.3, 0.9])
def test_top_p_never_leaves_the_nucleus(logits32, top_p, candidates, device):
    p = SamplingParams(temperature=0.9, top_p=top_p)
    probs = kept_distribution(logits32, p)
    tokens = draw(logits32, p, sampler=Sampler(candidates=candidates), device=device)
    assert set(tokens.tolist()) <= set(np.flatnonzero(probs).tolist())
    assert chi2_pvalue(tokens, probs) > 1e-3


@pytest.mark.parametrize("candidates", [4, 256])
def test_min_p_never_picks_below_the_threshold(logits32, candidates, device):
    p = SamplingParams(temperature=1.2, min_p=0.1)
    tokens = draw(logits32, p, sampler=Sampler(candidates=candidates), device=device)
    probs = torch.softmax(logits32 / 1.2, -1)
    assert (probs[tokens] >= 0.1 * probs.max()).all()
    assert chi2_pvalue(tokens, kept_distribution(logits32, p)) > 1e-3


def test_all_filters_together(logits32, device):
    p = SamplingParams(temperature=1.5, top_k=12, top_p=0.8, min_p=0.02)
    assert chi2_pvalue(draw(logits32, p, device=device), kept_distribution(logits32, p)) > 1e-3


def _big_nucleus_case():
    gen = torch.Generator().manual_seed(5)
    n, V = 16, 5000
    x = torch.randn(n, V, generator=gen) * torch.linspace(0.5, 4, n)[:, None]
    e = (x - x.amax(-1, keepdim=True)).exp()
    min_p = torch.tensor([0.0, 1e-3] * (n // 2))
    e = e.masked_fill(e < min_p[:, None], 0.0)
    top_p = torch.linspace(0.05, 0.99, n, dtype=torch.float64)
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    return e, top_p, min_p, u, e.sum(-1, dtype=torch.float64)


def test_pruned_nucleus_sort_equals_full_sort():
    case = _big_nucleus_case()
    assert torch.equal(_draw_big_nucleus(*case), _draw_big_nucleus_by_full_sort(*case))


def test_pruned_nucleus_sort_redoes_rows_when_the_bound_is_wrong(monkeypatch):
    case = _big_nucleus_case()
    expected = _draw_big_nucleus_by_full_sort(*case)
    real_bincount = torch.bincount

    def all_mass_at_the_top(keys, weights=None, minlength=0):  # claims every token is in bin 127
        return torch.zeros(minlength, dtype=torch.float64).index_fill_(
            0, torch.arange(127, minlength, 256), 1e9
        )

    monkeypatch.setattr(torch, "bincount", all_mass_at_the_top)
    assert torch.equal(_draw_big_nucleus(*case), expected)
    monkeypatch.setattr(torch, "bincount", real_bincount)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    temperature=st.floats(0.05, 3.0),
    top_k=st.sampled_from([-1, 1, 3, 10, 40]),
    top_p=st.floats(0.05, 1.0),
    min_p=st.sampled_from([0.0, 0.05, 0.5]),
    candidates=st.sampled_from([2, 8, 256]),
)
def test_drawn_tokens_are_always_in_the_kept_set(seed, temperature, top_k, top_p, min_p, candidates):
    logits = torch.randn(40, generator=torch.Generator().manual_seed(seed)) * 3
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    probs = kept_distribution(logits, p)
    # Leave out tokens within rounding of a cut: the two implementations may round them differently.
    tokens = draw(logits, p, n=200, sampler=Sampler(candidates=candidates), seed=seed)
    assert (probs[tokens] > 0).all() or _borderline(logits, p, tokens, probs)


def _borderline(logits, p, tokens, probs):
    bad = [t for t in tokens if probs[t] == 0]
    loose = kept_distribution(logits, p.replace(top_p=min(1.0, p.top_p * (1 + 1e-5))))
    return all(loose[t] > 0 for t in bad)


def test_greedy_is_argmax_and_mixes_with_sampled_rows(logits32, device):
    logits = torch.stack([logits32, -logits32, logits32.flip(0)]).to(device)
    rows = [
        SamplingRow(SamplingParams(temperature=0), [], []),
        SamplingRow(SamplingParams(temperature=1.0, top_k=1), [], []),
        SamplingRow(SamplingParams(temperature=0), [], []),
    ]
    out = Sampler()(logits, rows).token_ids
    assert out == [int(logits32.argmax()), int((-logits32).argmax()), int(logits32.flip(0).argmax())]
    assert Sampler()(logits.to(torch.bfloat16), rows).token_ids[0] == int(logits32.bfloat16().argmax())


# ----- seeds --------------------------------------------------------------------------------------
SEEDED = [
    SamplingParams(temperature=1.0, seed=7),
    SamplingParams(temperature=0.8, top_k=5, seed=7),
    SamplingParams(temperature=1.2, top_p=0.95, seed=7),  # nucleus overflows 4 candidates: sort path
    SamplingParams(temperature=1.0, min_p=0.05, top_p=0.5, seed=7),
]


def _seeded_run(params, batch_maker, steps=12, vocab=64, device="cpu"):
    sampler = Sampler(candidates=4)
    gen = make_generator(params.seed)
    data = torch.Generator().manual_seed(99)
    tokens = []
    for _ in range(steps):
        row_logits = torch.randn(vocab, generator=data)
        logits, rows, at = batch_maker(row_logits, SamplingRow(params, [], [], gen), vocab)
        tokens.append(sampler(logits.to(device), rows).token_ids[at])
    return tokens


def _alone(row_logits, row, vocab):
    return row_logits[None], [row], 0


def _crowded(first: bool):
    def make(row_logits, row, vocab):
        others = [
            SamplingRow(SamplingParams(temperature=0.5), [], []),
            SamplingRow(SamplingParams(temperature=0), [], []),
            SamplingRow(SamplingParams(top_p=0.2, top_k=3), [], []),
            SamplingRow(SamplingParams(seed=1), [], [], make_generator(1)),
        ]
        other_logits = torch.randn(len(others), vocab) * 3
        if first:
            return torch.cat([row_logits[None], other_logits]), [row, *others], 0
        return (
            torch.cat([other_logits[:2], row_logits[None], other_logits[2:]]),
            [*others[:2], row, *others[2:]],
            2,
        )

    return make


@pytest.mark.parametrize("params", SEEDED, ids=["plain", "top_k", "top_p_sort", "min_p_top_p"])
def test_seed_reproduces_regardless_of_batch(params, device):
    alone = _seeded_run(params, _alone, device=device)
    assert alone == _seeded_run(params, _alone, device=device)
    assert alone == _seeded_run(params, _crowded(first=True), device=device)
    assert alone == _seeded_run(params, _crowded(first=False), device=device)
    assert alone != _seeded_run(params.replace(seed=8), _alone, device=device)


def test_make_generator_streams():
    assert make_generator(None) is None
    a = torch.rand(4, generator=make_generator(5)).tolist()
    assert a == torch.rand(4, generator=make_generator(5, 0)).tolist()
    assert a != torch.rand(4, generator=make_generator(5, 1)).tolist()
    assert (
        torch.rand(4, generator=make_generator(5, 1)).tolist()
        != torch.rand(4, generator=make_generator(5, 2)).tolist()
    )


# ----- penalties ----------------------------------------------------------------------------------
def test_penalties_by_hand(device):
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0], [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]], device=device)
    rows = [
        SamplingRow(
            SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
            [0, 1],
            [3, 3, 4],
        ),
        SamplingRow(SamplingParams(presence_penalty=-1.0), [0, 1], [5, 5]),  # prompt is not penalized
    ]
    got = Sampler().apply_processors(logits, rows).clone()
    # row 0: repetition on {0, 1, 3, 4}: 2/2, -1*2, 3/2, -2*2; then 3 (x2): -0.5 - 0.5; 4 (x1): -0.5 - 0.25
    assert got[0].tolist() == [1.0, -2.0, 0.5, 0.5, -4.75, 0.0]
    assert got[1].tolist() == [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]
    assert logits[0, 0] == 2.0  # the input is never modified
    greedy = [
        SamplingRow(r.params.replace(temperature=0), r.prompt_token_ids, r.output_token_ids) for r in rows
    ]
    assert Sampler()(logits, greedy).token_ids == [0, 3]  # argmax of the penalized logits


def test_repetition_penalty_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 100, generator=gen) * 3
    ids = torch.randint(0, 100, (4, 30), generator=gen)
    for penalty in (0.7, 1.3, 2.0):
        expected = RepetitionPenaltyLogitsProcessor(penalty=penalty)(ids, logits.clone())
        rows = [
            SamplingRow(SamplingParams(repetition_penalty=penalty), ids[i, :20].tolist(), ids[i, 20:])
            for i in range(4)
        ]
        torch.testing.assert_close(Sampler().apply_processors(logits, rows), expected, rtol=0, atol=0)


def test_token_ids_outside_the_vocab_are_refused():
    rows = [SamplingRow(SamplingParams(repetition_penalty=1.2), [0, 10], [])]
    with pytest.raises(ValueError, match="outside the model vocabulary"):
        Sampler()(torch.zeros(1, 8), rows)


# ----- logprobs -----------------------------------------------------------------------------------
def test_logprobs_are_of_the_raw_distribution(device):
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 50, generator=gen) * 2
    params = [
        SamplingParams(temperature=0.5, logprobs=3, repetition_penalty=1.5, presence_penalty=1.0),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=2.0, top_k=5, logprobs=20),
    ]
    out = Sampler()(logits.to(device), [SamplingRow(p, [1, 2], [3, 3]) for p in params])
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs[2] is None
    for i, p in enumerate(params):
        lp = out.logprobs[i]
        if p.logprobs is None:
            continue
        tok = out.token_ids[i]
        assert lp.token_id == tok
        assert math.isclose(lp.logprob, raw[i, tok].item(), abs_tol=1e-5)
        assert lp.rank == 1 + int((raw[i] > raw[i, tok]).sum())
        assert len(lp.top) == p.logprobs
        assert [t for t, _ in lp.top] == torch.topk(raw[i], p.logprobs).indices.tolist()
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert all(math.isclose(v, raw[i, t].item(), abs_tol=1e-5) for t, v in lp.top)
    assert out.logprobs[1].rank == 1


# ----- min_tokens ---------------------------------------------------------------------------------
def test_min_tokens_masks_eos_and_stop_tokens():
    logits = torch.zeros(1, 10)
    logits[0, 0], logits[0, 5], logits[0, 7] = 100.0, 90.0, 50.0  # EOS, a stop token, a plain token
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5])
    sampler = Sampler()
    assert sampler(logits, [SamplingRow(p, [1], [7])], eos_token_ids=[0]).token_ids == [7]
    assert sampler(logits, [SamplingRow(p, [1], [7, 7, 7])], eos_token_ids=[0]).token_ids == [0]
    # ignore_eos: EOS is an ordinary token (vLLM), stop tokens stay masked until min_tokens.
    q = p.replace(ignore_eos=True)
    assert sampler(logits, [SamplingRow(q, [1], [7])], eos_token_ids=[0]).token_ids == [0]
    logits[0, 0] = 0.0
    assert sampler(logits, [SamplingRow(q, [1], [7])], eos_token_ids=0).token_ids == [7]
    # Sampled rows too: EOS never comes before min_tokens however likely it is.
    many = rows_of(SamplingParams(min_tokens=2), 500, output=[1])
    logits = torch.zeros(500, 10)
    logits[:, 0] = 5.0
    assert 0 not in Sampler()(logits, many, eos_token_ids=[0]).token_ids


# ----- thinking budget ---------------------------------------------------------------------------------
def test_reasoning_budget_forces_the_closing_tag_once_spent():
    from forwardpass.sampling.reasoning_budget import ReasoningBudget

    b = ReasoningBudget(3, start_ids=(7,), end_ids=(8, 9))  # a two-token closing tag
    assert b.forced_token([1, 2], [5, 5, 5, 5]) is None  # not reasoning: no tag anywhere
    assert b.forced_token([1, 7], [5, 5]) is None  # opened by the prompt, 2 of 3 spent
    assert b.forced_token([1, 7], [5, 5, 5]) == 8  # spent: the tag begins ...
    assert b.forced_token([1, 7], [5, 5, 5, 8]) == 9  # ... and is completed
    assert b.forced_token([1, 7], [5, 5, 5, 8, 9]) is None  # closed: the answer is free
    assert b.forced_token([1], [7, 5, 5, 5]) == 8  # opened by the output counts from the tag
    assert b.forced_token([1, 7, 4, 8, 9], [5] * 9) is None  # the prompt's block is already closed
    assert b.forced_token([1, 7], [5, 8]) is None  # the model began the tag itself within budget
    with pytest.raises(ValueError, match="max_reasoning_tokens"):
        ReasoningBudget(-1, (7,), (8,))


def test_reasoning_budget_in_the_sampler_overrides_even_a_certain_token():
    from forwardpass.sampling.reasoning_budget import ReasoningBudget
    from forwardpass.sampling.sampler import Sampler, SamplingRow

    logits = torch.zeros(2, 16)
    logits[:, 5] = 50.0  # the model is sure of token 5
    budget = ReasoningBudget(2, start_ids=(7,), end_ids=(8,))
    rows = [SamplingRow(SamplingParams(temperature=0.8, seed=1, reasoning_budget=budget), [7], [5, 5]),
            SamplingRow(SamplingParams(temperature=0.8, seed=1, reasoning_budget=budget), [7], [5])]
    assert Sampler()(logits, rows).token_ids == [8, 5]


def test_plain_argmax_is_false_for_every_processor():
    """``Sampler.plain_argmax`` (speculative verification's one-pass check) holds only for a greedy request
    that none of ``apply_processors``' stages touches: each stage's parameter alone turns it off."""
    from forwardpass.sampling.reasoning_budget import ReasoningBudget
    from forwardpass.sampling.sampler import Sampler as S

    assert S.plain_argmax(SamplingParams(temperature=0, logprobs=3, max_tokens=8, stop=["x"]))
    assert not S.plain_argmax(SamplingParams(temperature=1.0))
    stages = {"min_tokens": 2, "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5,
              "allowed_token_ids": [1, 2], "logit_bias": {3: 1.0},
              "structured_outputs": {"choice": ["a", "b"]},
              "reasoning_budget": ReasoningBudget(max_tokens=4, start_ids=(5,), end_ids=(6,))}
    for name, value in stages.items():
        assert not S.plain_argmax(SamplingParams(temperature=0, max_tokens=8, **{name: value})), name
