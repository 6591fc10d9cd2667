"""Speculative decoding, visible: ``forwardpass explain`` shows each step's proposed, accepted and rejected
drafts (from the engine's own step records), and the dashboard's state carries the acceptance rate."""

from __future__ import annotations

from types import SimpleNamespace

from forwardpass.config import EngineConfig
from forwardpass.engine.frontend.llm_engine import LLMEngine
from forwardpass.server.dashboard.state import spec_decode
from tests.test_speculative_fast_path import ALWAYS, copy_heavy_prompts


def test_explain_shows_proposed_accepted_and_rejected_drafts(checkpoint_factory):
    from rich.console import Console

    from forwardpass.explain import explain
    from forwardpass.explain.terminal import render

    engine = LLMEngine(checkpoint_factory("qwen3"), EngineConfig(num_kv_blocks=64, speculative_config=ALWAYS))
    ex = explain(copy_heavy_prompts(2)[1], engine=engine, max_tokens=20, temperature=0, ignore_eos=True,
                 hardware=None, overhead=None)
    spec = ex["speculation"]
    assert spec is not None and spec["steps"]
    for step in spec["steps"]:
        proposed = [t["id"] for t in step["proposed"]]
        emitted = [t["id"] for t in step["emitted"]]
        assert step["accepted"] + len(step["rejected"]) == len(proposed)
        assert emitted[: step["accepted"]] == proposed[: step["accepted"]]  # the accepted drafts came out
        if step["rejected"] and len(emitted) > step["accepted"]:  # the target's token replaced the first
            assert emitted[step["accepted"]] != step["rejected"][0]["id"]
    # the engine's own counts, and the steps' emitted tokens are the request's tokens
    records = list(engine.core.stats)
    assert spec["num_draft_tokens"] == sum(r.num_draft_tokens for r in records)
    accepted = sum(r.num_accepted_tokens for r in records)
    assert 0 < spec["num_accepted_tokens"] == accepted < spec["num_draft_tokens"]  # accepted and rejected
    generated = [t["id"] for t in ex["generated"]]
    for step in spec["steps"]:
        decode = [d for d in ex["decode"] if d["engine_step"] == step["engine_step"]]
        assert [d["token"] for d in decode] == [t["id"] for t in step["emitted"]]
        assert set(d["token"] for d in decode) <= set(generated)
    console = Console(record=True, width=200)
    render(ex, out=console)
    assert "speculative decoding:" in console.export_text()


def test_dashboard_state_carries_the_acceptance_rate():
    def record(drafts, accepted, lengths):
        return SimpleNamespace(num_draft_tokens=drafts, num_accepted_tokens=accepted,
                               acceptance_lengths=lengths)

    assert spec_decode([record(0, 0, ())]) is None  # no drafts verified: the card says so
    state = spec_decode([record(8, 6, (4, 4)), record(0, 0, ()), record(4, 1, (2,))])
    assert state == {"drafts": 12, "accepted": 7, "acceptance_rate": 7 / 12, "mean_acceptance_length": 10 / 3}
