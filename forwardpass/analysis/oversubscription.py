"""One warning when decode runs far slower than this machine allows because other work takes the cores.

On a machine with other work, compute threads that outnumber the free cores wait for each other at every
parallel region; decode then runs many times slower than the analyzer predicts (the issue that added this
measured 5-27x), silently. :class:`OversubscriptionWatch` reads the engine's step records after a request
and, when the median pure-decode step takes more than :data:`RATIO` times its prediction (roofline +
measured overhead, ``analysis/overhead.py``) **and** the load average exceeds the cores this process may use
(``forwardpass/threads.py``), logs one warning per process that says so and suggests ``--threads 1``.

The prediction needs this machine's measured hardware and overhead; they are read from their cache
(``forwardpass roofline MODEL --hardware this-machine`` or ``forwardpass explain`` measure them once), never
measured here: a command must not stall for a benchmark. Without them the watch stays silent.
"""

from __future__ import annotations

import json
import logging
import statistics
from collections.abc import Sequence
from typing import Any

log = logging.getLogger("forwardpass")

#: median decode step above this multiple of its prediction: far slower than the machine allows
RATIO = 3.0
#: pure-decode steps needed before judging (the first few include warm-up)
MIN_STEPS = 8

_warned: list[str] = []  # the warning said in this process (at most one)


def cached_prediction_inputs(device: str = "cpu") -> tuple[Any, Any] | None:
    """This machine's measured ``Hardware`` and ``Overhead`` from their cache (None if either is missing)."""
    from forwardpass.analysis.hardware import THIS_MACHINE, cache_path, hardware_from_measurement
    from forwardpass.analysis.overhead import Overhead

    try:
        doc = json.loads(cache_path().read_text())
        return hardware_from_measurement(doc[THIS_MACHINE]), Overhead(**doc[f"overhead-{device}"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class OversubscriptionWatch:
    """Judges an engine's decode steps against the prediction; warns once per process."""

    def __init__(self, layers: int, dtype: str = "fp32", inputs: tuple[Any, Any] | None = None,
                 device: str = "cpu") -> None:
        self.layers, self.dtype = layers, dtype
        self.inputs = inputs if inputs is not None else cached_prediction_inputs(device)

    def judge(self, records: Sequence[Any]) -> dict[str, float] | None:
        """Measured and predicted median decode step, their ratio, the load and cores; None when there is
        nothing to judge (no prediction, too few pure-decode steps)."""
        if self.inputs is None:
            return None
        recent = list(records)[-256:]  # a deque (the engine's records) does not slice
        steps = [r for r in recent if r.num_decode_tokens and not r.num_prefill_tokens]
        if len(steps) < MIN_STEPS:
            return None
        from forwardpass.analysis.overhead import predict_step
        from forwardpass.analysis.regime import load_average
        from forwardpass.threads import usable_cores

        hw, oh = self.inputs
        measured = statistics.median(r.duration_s for r in steps)
        predicted = statistics.median(
            predict_step(r.flops, r.bytes, self.layers, hw.peak(self.dtype), hw.bandwidth, oh).time_s
            for r in steps)
        load = load_average()
        return {"measured_s": measured, "predicted_s": predicted, "ratio": measured / predicted,
                "load": -1.0 if load is None else load, "cores": float(usable_cores())}

    def observe(self, records: Sequence[Any]) -> str | None:
        """Log the warning (once per process) if the steps say decode is oversubscribed; returns it."""
        if _warned:
            return None
        j = self.judge(records)
        if not oversubscribed(j):
            return None
        import torch

        message = warning_text(j, torch.get_num_threads())
        _warned.append(message)
        log.warning("%s", message)
        return message


def oversubscribed(judged: dict[str, float] | None) -> bool:
    """What :meth:`OversubscriptionWatch.judge` found calls for the warning."""
    return judged is not None and judged["ratio"] > RATIO and judged["load"] > judged["cores"]


def warning_text(judged: dict[str, float], threads: int) -> str:
    """The warning for a judgement that :func:`oversubscribed` accepts, with the advice for ``threads``."""
    j = judged
    advice = ("; try --threads 1 (LLM(num_threads=1)), or as many as the cores left free"
              if threads > 1 else "; other processes are taking the cores")
    return (f"decode steps take {j['measured_s'] * 1e3:.1f} ms, {j['ratio']:.0f}x the "
            f"{j['predicted_s'] * 1e3:.1f} ms predicted for this machine, and the load average "
            f"({j['load']:.1f}) exceeds the {j['cores']:.0f} core(s) this process may use: its "
            f"{threads} compute thread(s) compete with other work{advice}")


def warning_logged() -> str | None:
    """The warning this process logged, if it did (the dashboard shows it)."""
    return _warned[0] if _warned else None


def watch_engine(engine: Any) -> OversubscriptionWatch:
    """A watch for an ``LLMEngine`` (its spec's layers, its dtype, its device)."""
    import torch

    config = engine.core.config
    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(config.torch_dtype, "fp32")
    return OversubscriptionWatch(engine.spec.layers, dtype, device=config.device.split(":")[0])
