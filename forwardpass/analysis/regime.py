"""Which regime a measured step ran in, and why when it ran far slower than predicted.

The prediction (``overhead.predict_step``: compute, memory and the measured fixed overhead) names the bound
a step should have. A measured step more than :data:`OVERHEAD_RATIO` times its prediction did not run in
that regime, whatever it was predicted to be: something outside the model's arithmetic and bytes took the
time, so it is labelled ``overhead`` and the likely cause is read from the process's CPU time over the
step's wall time (``cpu_s / wall_s``, all threads together):

* well under one core's worth (< :data:`OFF_CPU`): the process was off the CPU — descheduled in favour of
  other processes (``other_processes``, when the load average exceeds the usable cores) or blocked
  (``waiting``: a sleep, I/O, a lock);
* more than one core's worth with several threads (> :data:`SPINNING`): the threads were busy without the
  work going faster — waiting on each other at every parallel region (``threads_waiting``; the fix is fewer
  threads, ``--threads 1``);
* about one core: single-threaded work the model's FLOPs and bytes do not count — the interpreter and
  operator dispatch between kernels (``python_overhead``).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

REGIMES = ("compute", "memory", "overhead")
#: measured above this multiple of the prediction: the step is overhead-bound, whatever was predicted
OVERHEAD_RATIO = 3.0
#: CPU time per wall second below which the process was mostly off the CPU
OFF_CPU = 0.7
#: CPU time per wall second above which several threads were busy at once (spinning, with nothing to show)
SPINNING = 1.3

CAUSES = {
    "other_processes": "the process was off the CPU for most of the step while the load average exceeded "
                       "the usable cores: other processes took the cores (try --threads 1)",
    "waiting": "the process was off the CPU for most of the step (a sleep, I/O or a lock), not computing",
    "threads_waiting": "several threads were busy for the whole step without finishing sooner: they waited "
                       "on each other (more threads than free cores; try --threads 1)",
    "python_overhead": "one core was busy for the whole step: single-threaded work between the kernels "
                       "(the interpreter, operator dispatch) that the FLOPs and bytes do not count",
}


@dataclass(frozen=True)
class StepRegime:
    measured_s: float
    predicted_s: float
    ratio: float  # measured / predicted
    regime: str  # one of REGIMES
    cpu_s: float | None = None  # the process's CPU time over the step (all threads)
    cpu_per_wall: float | None = None
    cause: str | None = None  # a key of CAUSES, for an overhead-bound step whose CPU time was measured
    cause_text: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def likely_cause(cpu_s: float, wall_s: float, threads: int, load: float | None, cores: int) -> str:
    """The key of :data:`CAUSES` that the step's CPU time over wall time points to."""
    per_wall = cpu_s / wall_s if wall_s > 0 else 0.0
    if per_wall < OFF_CPU:
        return "other_processes" if load is not None and load > cores else "waiting"
    if threads > 1 and per_wall > SPINNING:
        return "threads_waiting"
    return "python_overhead"


def classify(measured_s: float, predicted_s: float, predicted_bound: str | None, *,
             cpu_s: float | None = None, wall_s: float | None = None, threads: int | None = None,
             load: float | None = None, cores: int | None = None) -> StepRegime:
    """The regime of a step measured at ``measured_s`` against its prediction (``predicted_bound`` is the
    prediction's own bound); ``cpu_s`` over ``wall_s`` (default: ``measured_s``) gives the cause."""
    from forwardpass.threads import usable_cores

    ratio = measured_s / predicted_s if predicted_s > 0 else float("inf")
    regime = "overhead" if ratio > OVERHEAD_RATIO or predicted_bound not in REGIMES else predicted_bound
    wall = measured_s if wall_s is None else wall_s
    per_wall = cpu_s / wall if cpu_s is not None and wall > 0 else None
    cause = None
    if regime == "overhead" and cpu_s is not None:
        import torch

        cause = likely_cause(cpu_s, wall, threads or torch.get_num_threads(),
                             load if load is not None else load_average(), cores or usable_cores())
    return StepRegime(measured_s, predicted_s, ratio, regime, cpu_s, per_wall, cause,
                      CAUSES.get(cause) if cause else None)
