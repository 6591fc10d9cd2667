"""A run of steps' measured cost against the roofline's prediction: what every explain view shows per step."""

from __future__ import annotations

from typing import Any

from forwardpass.engine.scheduling.stats import StepRecord


def step_cost(records: list[StepRecord], layers: int, hw: Any, dtype: str, overhead: Any,
              cpu: tuple[float, float] | None = None) -> dict[str, Any]:
    """The records' measured cost against the prediction; ``cpu``: the process's (CPU, wall) seconds over
    those steps, which names the cause of an overhead-bound step (``analysis/regime.py``)."""
    flops = sum(r.flops for r in records)
    nbytes = sum(r.bytes for r in records)
    t = sum(r.duration_s for r in records)
    d: dict[str, Any] = {
        "time_s": t, "flops": flops, "bytes": nbytes,
        "intensity": flops / nbytes if nbytes else 0.0,
        "achieved_flops_per_s": flops / t if t else 0.0,
        "achieved_bytes_per_s": nbytes / t if t else 0.0,
        "bound": None,
    }
    if hw is not None:
        from forwardpass.analysis.overhead import predict_step

        pred = predict_step(flops, nbytes, layers * len(records), hw.peak(dtype), hw.bandwidth, None)
        if overhead is not None:  # one fixed cost per step, one per layer per step
            pred = type(pred)(pred.compute_s, pred.memory_s, len(records) * overhead.time_s(layers))
        d.update(pred.to_dict())
        d["mfu"] = d["achieved_flops_per_s"] / hw.peak(dtype)
        d["mbu"] = d["achieved_bytes_per_s"] / hw.bandwidth
        from forwardpass.analysis.regime import classify

        cpu_s, wall_s = cpu if cpu is not None else (None, None)
        d.update(classify(t, d["predicted_s"], d["bound"], cpu_s=cpu_s, wall_s=wall_s).to_dict())
    return d
