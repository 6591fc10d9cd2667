"""At temperature 1 the tokens speculative decoding emits follow the target model's distribution, even
with a draft that disagrees with the target on purpose; and the test catches a broken acceptance rule.

A 16-token-vocabulary model; a test-only proposer drafts 2 tokens drawn from a distribution unlike the
target's. The prefill step samples ``x0``; the next step verifies the drafts, emitting ``x1`` (the first
draft accepted, or replaced) and, when it was accepted, ``x2``. The empirical joint distribution of
``(x1, x2)`` is compared with the target's exact one, ``sum_x0 p(x0) p(x1 | x0) p(x2 | x0, x1)``, read from
the engine's own logprobs (all 16 tokens of 273 contexts), by a chi-square test at
significance 0.001. Every request is seeded, so the test is deterministic: it passes or fails the same way
on every run. With "always accept" as the rule it must fail: the emitted tokens then follow the drafts.
"""

from __future__ import annotations

import math

import pytest
import torch

from forwardpass import LLM, SamplingParams
from forwardpass.engine.speculative import verify

VOCAB = 16
SIGNIFICANCE = 1e-3
PROMPT = [3, 9, 4, 12, 5]
SAMPLES = 2000  # 4 requests x n=500


class DisagreeingProposer:
    """Drafts 2 tokens: the target's least likely ones most of the time (so most drafts are rejected),
    token 0 otherwise; a fixed generator keeps the test deterministic."""

    def __init__(self, unlikely: list[int]):
        self.unlikely = unlikely
        self.gen = torch.Generator().manual_seed(0)

    def propose(self, token_ids, k):
        picks = torch.randint(0, 2 * len(self.unlikely), (k,), generator=self.gen).tolist()
        return tuple(self.unlikely[i] if i < len(self.unlikely) else 0 for i in picks)


@pytest.fixture(scope="module")
def path(checkpoint_factory):
    # initializer_range 0.5: a peaked but not degenerate next-token distribution over 16 tokens
    return checkpoint_factory("qwen3", vocab_size=VOCAB, initializer_range=0.5, num_hidden_layers=1)


def next_token_probs(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """The target's exact next-token distribution after each prompt (logprobs of all VOCAB tokens: the sampled
    token and the top VOCAB)."""
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=VOCAB, ignore_eos=True)
    probs = torch.zeros(len(prompts), VOCAB, dtype=torch.float64)
    for i, out in enumerate(llm.generate(prompts, params, use_tqdm=False)):
        for tok, lp in out.outputs[0].logprobs[0].items():
            probs[i, tok] = math.exp(lp.logprob)
    assert torch.allclose(probs.sum(-1), torch.ones(len(prompts), dtype=torch.float64), atol=1e-4)
    return probs


def chi_square_p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's test; cells expected fewer than 5 times are pooled into one."""
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.parametrize("broken", [False, True], ids=["rejection_rule", "always_accept"])
def test_emitted_tokens_follow_the_target(path, broken, monkeypatch):
    llm = LLM(path, num_kv_blocks=1024, max_num_seqs=512, max_num_batched_tokens=4096,
              enable_prefix_caching=True, speculative_config={
                  "method": "ngram", "num_speculative_tokens": 2, "adaptive": False,
                  "disable_by_batch_size": None})
    p0 = next_token_probs(llm, [PROMPT])[0]
    p1 = next_token_probs(llm, [PROMPT + [x] for x in range(VOCAB)])
    p2 = next_token_probs(llm, [PROMPT + [x, y] for x in range(VOCAB) for y in range(VOCAB)])
    target = (p0[:, None, None] * p1[:, :, None] * p2.view(VOCAB, VOCAB, VOCAB)).sum(0)  # P(x1, x2)
    unlikely = p0.argsort()[:4].tolist()
    llm.engine.core.scheduler.speculator.proposer = DisagreeingProposer(unlikely)  # test-only draft
    if broken:
        monkeypatch.setattr(verify, "accepts", lambda sampled, draft: True)
    outs, counts = sample_pairs(llm)
    drafts = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert drafts >= SAMPLES and accepted > 0  # every sample verified drafts
    assert broken or accepted < drafts  # the correct rule rejects some
    p_value = chi_square_p_value(counts.flatten(), SAMPLES * target.flatten())
    if broken:
        assert p_value < SIGNIFICANCE, f"always-accept passed the test (p = {p_value:.3g}): it has no power"
    else:
        assert p_value > SIGNIFICANCE, f"speculative sampling does not follow the target (p = {p_value:.3g})"
    llm.engine.check_invariants()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def sample_pairs(llm) -> tuple[list, torch.Tensor]:
    """SAMPLES seeded samples of PROMPT at temperature 1: the outputs and the counts of (x1, x2)."""
    per_request = 500
    params = [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, n=per_request, seed=100 + r)
              for r in range(SAMPLES // per_request)]
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for out in outs:
        for c in out.outputs:
            counts[c.token_ids[1], c.token_ids[2]] += 1
    assert counts.sum() == SAMPLES
    return outs, counts
