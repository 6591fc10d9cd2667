"""The chi-square test of ``test_speculative_draft_distribution.py`` with ``method: mtp``: DeepSeek-V3's
next-token-prediction layer draws its drafts from its own distribution ``q`` (it has its own LM head here, so
``q`` disagrees with the target's ``p``) and the full rejection rule verifies them
(``engine/speculative/draft_verify.py``). The joint distribution of the two tokens a verify of 2 drafts
decides must match the target's exact one at significance 0.001; with the rule broken (a rejected draft
resampled from ``p`` instead of the residual, or every draft accepted) the same test must fail. Seeded.
"""

from __future__ import annotations

import pytest

from forwardpass import LLM
from forwardpass.engine.speculative import draft_verify
from tests.helpers.mtp_checkpoints import make_mtp_checkpoint
from tests.test_speculative_distribution import (
    PROMPT,
    SAMPLES,
    SIGNIFICANCE,
    VOCAB,
    chi_square_p_value,
    next_token_probs,
    sample_pairs,
)

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The engine, and the target's exact joint distribution of the two tokens after the prefill's."""
    path = make_mtp_checkpoint(tmp_path_factory.mktemp("mtp16"), vocab_size=VOCAB, initializer_range=0.5)
    llm = LLM(path, num_threads=1, num_kv_blocks=1024, max_num_seqs=512, max_num_batched_tokens=4096,
              enable_prefix_caching=True, speculative_config={
                  "method": "mtp", "num_speculative_tokens": 2, "adaptive": False,
                  "disable_by_batch_size": None})
    p0 = next_token_probs(llm, [PROMPT])[0]
    p1 = next_token_probs(llm, [PROMPT + [x] for x in range(VOCAB)])
    p2 = next_token_probs(llm, [PROMPT + [x, y] for x in range(VOCAB) for y in range(VOCAB)])
    return llm, (p0[:, None, None] * p1[:, :, None] * p2.view(VOCAB, VOCAB, VOCAB)).sum(0)  # P(x1, x2)


def _always_accept(p, q, draft, generator):
    return draft


def _resample_from_p(p, q):
    return p.clone()


@pytest.mark.parametrize("broken", [None, "resample_from_p", "always_accept"])
def test_mtp_samples_follow_the_target(engine, broken, monkeypatch):
    llm, target = engine
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
    assert drafts >= SAMPLES and rounds[0] >= SAMPLES  # every sample verified MTP drafts, by the full rule
    p_value = chi_square_p_value(counts.flatten(), SAMPLES * target.flatten())
    if broken:
        assert p_value < SIGNIFICANCE, f"{broken} passed the test (p = {p_value:.3g}): it has no power"
        return
    assert 0 < accepted < drafts
    assert p_value > SIGNIFICANCE, f"MTP speculative sampling does not follow the target (p = {p_value:.3g})"
    llm.engine.check_invariants()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
