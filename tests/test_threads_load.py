"""A loaded machine (busy-loop processes started here) and the oversubscription warning
(forwardpass/analysis/oversubscription.py), and `--threads 1` against the default under that load.

The decode runs in a child process with ``OMP_WAIT_POLICY=active`` (spinning OpenMP workers: what a process
gets when it imports torch before forwardpass, or sets the policy itself): that is where too many threads
cost most. With forwardpass's own wait (passive with a bounded spin) the same load costs far less; the slow
test prints both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from benchmarks import threads_under_load
from forwardpass.analysis.oversubscription import oversubscribed
from forwardpass.threads import usable_cores
from tests.helpers.fast_machine import fast_machine_env


@contextlib.contextmanager
def busy_machine(per_core: int = 2, wait_s: float = 120.0) -> Iterator[int]:
    """benchmarks/threads_under_load.py's busy loops; a skip when the load average does not rise."""
    try:
        with threads_under_load.busy_machine(per_core, wait_s) as cores:
            yield cores
    except TimeoutError as exc:
        pytest.skip(str(exc))


def _child(policy: str, rounds: int, tokens: int, modes: str = "default,one",
           env_extra: dict[str, str] | None = None) -> dict:
    return threads_under_load.run_child(policy, rounds, tokens, modes, env_extra)


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


def test_a_loaded_machine_triggers_one_warning_and_the_default_stays_near_one_thread(prediction_cached,
                                                                                      tmp_path):
    """Under a real load (busy loops, load average above the cores), spinning workers
    (OMP_WAIT_POLICY=active):

    - with this machine's own prediction, the warning fires exactly when the judge finds a decode step more
      than 3x its prediction (how much slower the load makes a step is up to the host's scheduler: 8-14x in
      our runs, 1.9x in one CI run, where no warning is the right answer);
    - with a prediction every real step exceeds (a fast machine's cache), two slow requests give exactly one
      warning, suggesting --threads 1 (once per process).

    forwardpass's own wait (passive with a bounded spin, forwardpass.OPENMP_WAIT): the default thread count
    decodes within 4x of one thread under the same load (medians of five paired rounds), so the default does
    not collapse as spinning workers do (8-14x; 17x in one CI run with a spin of 100,000, 120 against
    7 tok/s). The bounded spin trades some speed under load for speed on a quiet machine (2.1-2.5x decode
    there, docs/cli.md "Threads"): with 1,000 the paired medians were 1.2-3.2x on a Zen 4 VM under two busy
    loops per core (twelve children; the loaded default steadies at 120-200 tok/s, the single thread gets
    160-620 as the scheduler pleases), against 1.0-2.0x with passive alone (2.2x once in a full-suite run)."""
    if usable_cores() < 2:
        pytest.skip("one usable core: the default is already one thread")
    with busy_machine():
        own = _child("active", rounds=2, tokens=12, modes="default")  # two requests, 11 decode steps each
        fast = _child("active", rounds=2, tokens=12, modes="default", env_extra=fast_machine_env(tmp_path))
        own_wait = _child("default", rounds=5, tokens=12)  # paired: default and one thread, alternating
    for result in (own, fast):
        assert result["default_threads"] >= 2
    judged_slow = any(oversubscribed(j) for j in own["judgements"])
    print(f"this machine's prediction: judge ratios {own['ratios']['default']}, warnings {own['warnings']}")
    own_warnings = [w for w in own["warnings"] if "decode steps take" in w]
    assert len(own_warnings) == (1 if judged_slow else 0), own
    assert all(oversubscribed(j) for j in fast["judgements"]), fast
    warnings = [w for w in fast["warnings"] if "decode steps take" in w]
    assert len(warnings) == 1, fast  # once per process, though two requests ran slow
    assert "exceeds the" in warnings[0] and "--threads 1" in warnings[0]
    one, default = _median(own_wait["rates"]["one"]), _median(own_wait["rates"]["default"])
    print(f"forwardpass's wait: --threads 1 {one:.0f} tok/s, default {default:.0f} tok/s: "
          f"{one / default:.1f}x")
    assert one <= 4.0 * default, own_wait


@pytest.mark.slow
def test_one_thread_against_the_default_under_load(prediction_cached):
    """Paired, alternating decode rates; the ratio is asserted for spinning workers (8.3x and 13.6x on a
    shared 2-core Xeon), printed for forwardpass's own wait (passive alone: 1.1x, and 0.4x on a host with a
    load average of 11-15: there the default was the faster). benchmarks/threads_under_load.py measures
    each policy with more rounds."""
    if usable_cores() < 2:
        pytest.skip("one usable core")
    with busy_machine():
        active = _child("active", rounds=4, tokens=32)
        own_wait = _child("default", rounds=4, tokens=32)
    for name, r in (("active", active), ("forwardpass's wait", own_wait)):
        one, default = sorted(r["rates"]["one"]), sorted(r["rates"]["default"])
        print(f"{name}: --threads 1 {one} tok/s, default ({r['default_threads']}) {default} tok/s, median "
              f"ratio {one[len(one) // 2] / default[len(default) // 2]:.1f}x")
    assert _median(active["rates"]["one"]) >= 3 * _median(active["rates"]["default"]), active
