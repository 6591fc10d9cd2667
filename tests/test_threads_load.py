"""A loaded machine (busy-loop processes started here) and the oversubscription warning
(forwardpass/analysis/oversubscription.py), and `--threads 1` against the default under that load.

The decode runs in a child process with ``OMP_WAIT_POLICY=active`` (spinning OpenMP workers: what a process
gets when it imports torch before forwardpass, or sets the policy itself): that is where too many threads
cost most. With forwardpass's own default (passive) the same load costs far less; the slow test prints both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from benchmarks import threads_under_load
from forwardpass.threads import usable_cores


@contextlib.contextmanager
def busy_machine(per_core: int = 2, wait_s: float = 120.0) -> Iterator[int]:
    """benchmarks/threads_under_load.py's busy loops; a skip when the load average does not rise."""
    try:
        with threads_under_load.busy_machine(per_core, wait_s) as cores:
            yield cores
    except TimeoutError as exc:
        pytest.skip(str(exc))


def _child(policy: str, rounds: int, tokens: int, modes: str = "default,one") -> dict:
    return threads_under_load.run_child(policy, rounds, tokens, modes)


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


@pytest.fixture(scope="module")
def prediction_cached():
    """The warning compares with this machine's measured roofline and overhead: measured (once, cached)
    before the load starts, so the load does not skew them."""
    from forwardpass.analysis.hardware import this_machine
    from forwardpass.analysis.overhead import this_machine_overhead
    from forwardpass.analysis.oversubscription import cached_prediction_inputs

    if cached_prediction_inputs() is None:
        this_machine()
        this_machine_overhead()
    assert cached_prediction_inputs() is not None


def test_a_loaded_machine_triggers_one_warning_and_the_default_stays_near_one_thread(prediction_cached):
    """Spinning workers (OMP_WAIT_POLICY=active): one warning suggesting --threads 1. forwardpass's own
    default (passive): the default thread count decodes within 2x of one thread under the same load
    (spinning: 8-14x slower in our runs), so the default no longer collapses."""
    if usable_cores() < 2:
        pytest.skip("one usable core: the default is already one thread")
    with busy_machine():
        active = _child("active", rounds=2, tokens=12, modes="default")  # two requests, 11 decode steps each
        passive = _child("passive", rounds=2, tokens=12)  # paired: default and one thread, alternating
    assert active["default_threads"] >= 2
    warnings = [w for w in active["warnings"] if "decode steps take" in w]
    assert len(warnings) == 1, active  # once per process, though two requests ran slow
    assert "exceeds the" in warnings[0] and "--threads 1" in warnings[0]
    one, default = _median(passive["rates"]["one"]), _median(passive["rates"]["default"])
    assert one <= 2.0 * default, passive


@pytest.mark.slow
def test_one_thread_against_the_default_under_load(prediction_cached):
    """Paired, alternating decode rates; the ratio is asserted for spinning workers (8.3x and 13.6x on a
    shared 2-core Xeon), printed for the passive policy forwardpass sets by default (1.1x, and 0.4x on a host
    with a load average of 11-15: there the default was the faster). benchmarks/threads_under_load.py
    measures both with more rounds."""
    if usable_cores() < 2:
        pytest.skip("one usable core")
    with busy_machine():
        active = _child("active", rounds=4, tokens=32)
        passive = _child("passive", rounds=4, tokens=32)
    for name, r in (("active", active), ("passive", passive)):
        one, default = sorted(r["rates"]["one"]), sorted(r["rates"]["default"])
        print(f"{name}: --threads 1 {one} tok/s, default ({r['default_threads']}) {default} tok/s, median "
              f"ratio {one[len(one) // 2] / default[len(default) // 2]:.1f}x")
    assert _median(active["rates"]["one"]) >= 3 * _median(active["rates"]["default"]), active
