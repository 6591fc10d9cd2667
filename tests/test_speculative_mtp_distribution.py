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
from tests.helpers.mtp_checkpoints import make_mtp_checkpoint
from tests.test_speculative_distribution import VOCAB
from tests.test_speculative_draft_distribution import check_full_rule, joint_two_tokens

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The engine, and the target's exact joint distribution of the two tokens after the prefill's."""
    path = make_mtp_checkpoint(tmp_path_factory.mktemp("mtp16"), vocab_size=VOCAB, initializer_range=0.5)
    llm = LLM(path, num_threads=1, num_kv_blocks=1024, max_num_seqs=512, max_num_batched_tokens=4096,
              enable_prefix_caching=True, speculative_config={
                  "method": "mtp", "num_speculative_tokens": 2, "adaptive": False,
                  "disable_by_batch_size": None})
    return llm, joint_two_tokens(llm)


@pytest.mark.parametrize("broken", [None, "resample_from_p", "always_accept"])
def test_mtp_samples_follow_the_target(engine, broken, monkeypatch):
    llm, target = engine
    check_full_rule(llm, target, broken, monkeypatch)
