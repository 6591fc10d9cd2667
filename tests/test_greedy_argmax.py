"""The greedy token (``sampling/argmax.py``): numpy's argmax must answer as torch's does (the first of equal
maxima, NaN the largest), and the sampler and the verify step must take it."""

from __future__ import annotations

import torch

from forwardpass.sampling import argmax as argmax_module
from forwardpass.sampling.argmax import greedy_tokens


def _rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 49152, generator=g)
    x[1, [7, 300, 40000]] = 50.0  # equal maxima: the first wins
    x[2, [5, 49151]] = float("inf")
    x[3, [11, 900]] = float("nan")  # NaN counts as the largest: the first NaN
    x[3, 4] = float("inf")
    x[4].fill_(float("-inf"))  # every entry -inf: index 0
    x[5].fill_(0.0)
    x[6, -1] = 1e9  # the last entry
    x[7, 0] = 1e9  # the first entry
    return x


def test_matches_torch_argmax():
    x = _rows()
    want = torch.argmax(x, dim=-1)
    assert torch.equal(greedy_tokens(x), want)
    assert greedy_tokens(x).dtype == torch.int64
    for i in range(x.shape[0]):  # one row: a 0-d tensor, as torch's
        got = greedy_tokens(x[i])
        assert got.dim() == 0 and int(got) == int(want[i])
    strided = x[::2, ::3]  # a view with strides
    assert torch.equal(greedy_tokens(strided), torch.argmax(strided, dim=-1))
    with torch.inference_mode():
        assert torch.equal(greedy_tokens(x.clone()), want)


def test_other_dtypes_keep_torch():
    x = _rows()[:, :1000].to(torch.bfloat16)
    x[3].nan_to_num_(0.0)  # (bfloat16 max and argmax agree on finite rows)
    assert torch.equal(greedy_tokens(x), torch.argmax(x, dim=-1))


def test_sampler_and_verify_take_it(monkeypatch):
    from forwardpass.engine.speculative import verify
    from forwardpass.sampling import sampler

    calls = []

    def counting(x):
        calls.append(tuple(x.shape))
        return argmax_module.greedy_tokens(x)

    monkeypatch.setattr(sampler, "greedy_tokens", counting)
    monkeypatch.setattr(verify, "greedy_tokens", counting)
    from forwardpass import LLM, SamplingParams

    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "adaptive": False}  # every draft verified: the step times cannot turn speculation off
    llm = LLM(max_num_seqs=2, speculative_config=spec)
    out = llm.generate(["one two three one two three one two"], SamplingParams(temperature=0, max_tokens=12),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 12
    assert calls and any(rows > 1 for rows, *_ in calls), calls  # plain steps and verify steps
