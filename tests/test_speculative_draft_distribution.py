"""The chi-square test of ``test_speculative_distribution.py`` with a real draft model: drafts drawn from the
draft's own distribution ``q`` (not a point mass) and verified by the full rejection rule
(``engine/speculative/draft_verify.py``: accept with ``min(1, p/q)``, else draw from ``norm(max(0, p - q))``).

The target is the 16-token model of that test; the draft is another random model of the same vocabulary, so
``q`` disagrees with ``p`` everywhere. The joint distribution of the two tokens a verify of 2 drafts decides
must match the target's exact one at significance 0.001; with the rule broken (a rejected draft resampled
from ``p`` instead of the residual, the classic mistake, or every draft accepted) the same test must fail.
Every request is seeded and the draft's draws come from per-sequence generators, so it is deterministic.
"""

from __future__ import annotations

import pytest

from forwardpass import LLM
from forwardpass.engine.speculative import draft_verify
from tests.test_speculative_distribution import (
    PROMPT,
    SAMPLES,
    SIGNIFICANCE,
    VOCAB,
    chi_square_p_value,
    next_token_probs,
    sample_pairs,
)


@pytest.fixture(scope="module")
def engine(checkpoint_factory):
    """The engine, and the target's exact joint distribution of the two tokens after the prefill's."""
    target_path = checkpoint_factory("qwen3", vocab_size=VOCAB, initializer_range=0.5, num_hidden_layers=1)
    draft_path = checkpoint_factory("llama", vocab_size=VOCAB, initializer_range=0.5, num_hidden_layers=1,
                                    hidden_size=32, intermediate_size=64)
    llm = LLM(target_path, num_threads=1, num_kv_blocks=1024, max_num_seqs=512,
              max_num_batched_tokens=4096, enable_prefix_caching=True, speculative_config={
                  "method": "draft_model", "model": str(draft_path), "num_speculative_tokens": 2,
                  "adaptive": False, "disable_by_batch_size": None})
    return llm, joint_two_tokens(llm)


def joint_two_tokens(llm):
    """The target's exact joint distribution P(x1, x2) of the two tokens after PROMPT's first one."""
    p0 = next_token_probs(llm, [PROMPT])[0]
    p1 = next_token_probs(llm, [PROMPT + [x] for x in range(VOCAB)])
    p2 = next_token_probs(llm, [PROMPT + [x, y] for x in range(VOCAB) for y in range(VOCAB)])
    return (p0[:, None, None] * p1[:, :, None] * p2.view(VOCAB, VOCAB, VOCAB)).sum(0)


def _always_accept(p, q, draft, generator):
    return draft


def _resample_from_p(p, q):
    return p.clone()


def check_full_rule(llm, target, broken, monkeypatch) -> None:
    """Sample PROMPT through ``llm`` (whose drafts carry their own ``q``) with the full rule as it is or
    ``broken``, and test the pairs against ``target``: the rule must pass, each broken form must fail."""
    rounds = [0]
    rule = draft_verify.reject_or_accept if broken != "always_accept" else _always_accept

    def counted(*args):
        rounds[0] += 1
        return rule(*args)

    monkeypatch.setattr(draft_verify, "reject_or_accept", counted)
    if broken == "resample_from_p":
        monkeypatch.setattr(draft_verify, "residual", _resample_from_p)
    outs, counts = sample_pairs(llm)
    drafts = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert drafts >= SAMPLES and rounds[0] >= SAMPLES  # every sample verified drafts, by the full rule
    p_value = chi_square_p_value(counts.flatten(), SAMPLES * target.flatten())
    if broken:
        assert p_value < SIGNIFICANCE, f"{broken} passed the test (p = {p_value:.3g}): it has no power"
        return
    assert 0 < accepted < drafts
    assert p_value > SIGNIFICANCE, f"speculative sampling does not follow the target (p = {p_value:.3g})"
    llm.engine.check_invariants()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.parametrize("broken", [None, "resample_from_p", "always_accept"])
def test_draft_model_samples_follow_the_target(engine, broken, monkeypatch):
    llm, target = engine
    check_full_rule(llm, target, broken, monkeypatch)
    if broken is None:
        cache = llm.engine.core.scheduler.speculator.proposer.cache
        assert cache.num_free_blocks == cache.num_blocks and not cache.sequences
