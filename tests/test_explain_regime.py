"""explain's overhead regime (forwardpass/analysis/regime.py): every measured step carries measured_s,
predicted_s, their ratio and a regime in {compute, memory, overhead}; a step more than 3x its prediction is
overhead-bound with a cause read from CPU time over wall time, never "memory"."""

from __future__ import annotations

import json
import time

import pytest

from forwardpass.analysis.regime import CAUSES, OVERHEAD_RATIO, REGIMES, classify, likely_cause
from forwardpass.cli import main

STEP_FIELDS = ("measured_s", "predicted_s", "ratio", "regime", "cpu_s", "cpu_per_wall", "cause")


def test_ratio_above_three_is_overhead_whatever_was_predicted():
    assert classify(0.010, 0.004, "memory").regime == "memory"  # 2.5x: still the predicted regime
    r = classify(0.255, 0.0035, "memory", cpu_s=0.02, wall_s=0.255, threads=2, load=9.0, cores=2)
    assert r.regime == "overhead" and r.ratio == pytest.approx(0.255 / 0.0035)
    assert r.cause == "other_processes" and "--threads 1" in r.cause_text
    assert classify(0.5, 0.1, "compute").regime == "overhead" and OVERHEAD_RATIO == 3.0


@pytest.mark.parametrize(("cpu", "wall", "threads", "load", "cause"), [
    (0.01, 0.10, 2, 8.0, "other_processes"),  # off the CPU, a busy machine
    (0.01, 0.10, 1, 0.5, "waiting"),  # off the CPU, a quiet machine: a sleep, I/O, a lock
    (0.19, 0.10, 2, 2.5, "threads_waiting"),  # two threads busy for the whole step
    (0.10, 0.10, 1, 0.5, "python_overhead"),  # one core busy for the whole step
    (0.10, 0.10, 2, 0.5, "python_overhead"),  # two threads, but one core's worth: the interpreter
])
def test_the_cause_follows_cpu_time_over_wall_time(cpu, wall, threads, load, cause):
    assert likely_cause(cpu, wall, threads, load, cores=2) == cause and cause in CAUSES


def _check_steps(steps: list[dict]) -> None:
    assert steps
    for s in steps:
        assert all(k in s for k in STEP_FIELDS), s.keys()
        assert s["regime"] in REGIMES and s["predicted_s"] > 0
        assert s["ratio"] == pytest.approx(s["measured_s"] / s["predicted_s"])
        if s["ratio"] > OVERHEAD_RATIO:
            assert s["regime"] == "overhead" and s["cause"] in CAUSES
        else:
            assert s["regime"] == s["bound"]


def test_explain_json_gives_every_step_its_regime(capsys):
    assert main(["explain", "Once upon a time", "--max-tokens", "4", "--json", "--threads", "1"]) == 0
    ex = json.loads(capsys.readouterr().out)
    _check_steps([ex["prefill"], *ex["decode"]])
    assert all(p["regime"] in REGIMES for p in ex["roofline"]["points"])


def test_a_step_slowed_from_outside_is_overhead_bound_not_memory(monkeypatch):
    """A 40 ms sleep inside every engine step (the model's work is ~1-10 ms): > 3x the prediction, off the
    CPU: labelled overhead with an off-CPU cause."""
    from forwardpass.assets import default_llm_path
    from forwardpass.config import EngineConfig
    from forwardpass.engine.frontend.llm_engine import LLMEngine
    from forwardpass.explain import explain

    engine = LLMEngine(default_llm_path(), EngineConfig(num_kv_blocks=32))
    execute = engine.core.runner.execute

    def slow_execute(*args, **kwargs):
        time.sleep(0.04)
        return execute(*args, **kwargs)

    monkeypatch.setattr(engine.core.runner, "execute", slow_execute)
    ex = explain("Once upon a time", engine=engine, max_tokens=3)
    steps = [ex["prefill"], *ex["decode"]]
    _check_steps(steps)
    for s in steps:
        assert s["measured_s"] >= 0.04 and s["regime"] == "overhead", s
        assert s["cause"] in ("waiting", "other_processes") and s["cpu_per_wall"] < 0.7
    engine.check_invariants()


def test_explain_image_steps_carry_their_regime():
    from forwardpass.explain.image import explain_image, to_json

    ex = to_json(explain_image("a handwritten 7", steps=3, student_steps=2, frames=2))
    for run in ex["runs"]:
        _check_steps(run["per_step"])
