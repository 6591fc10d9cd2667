"""Batching raises arithmetic intensity, measured: the same request decoded alone and beside copies of itself.

For each batch size B, B copies of the prompt are added at once (the copies after the first find its blocks in
the prefix cache) and, once every copy decodes, ``steps`` pure decode steps are timed by the engine itself
(its ``StepRecord``: tokens, seconds, FLOPs and bytes from the analyzer's accounting). A decode step reads
every weight once whatever B is, so its FLOPs grow with B and its bytes hardly do: the FLOP per byte rises
with B, the step moves from the bandwidth roof toward the compute roof, and the time per token falls until
compute binds."""

from __future__ import annotations

import time
from typing import Any

from forwardpass.engine.scheduling.stats import StepRecord
from forwardpass.explain.cost import step_cost

DEFAULT_BATCH_SIZES = (1, 4, 16, 32)


def batching_sweep(engine: Any, prompt_ids: list[int], batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES,
                   *, steps: int = 6, hw: Any = None, dtype_name: str = "fp32",
                   overhead: Any = None) -> list[dict]:
    """One row per batch size: ``batch``, ``tokens_per_s`` and ``step_cost``'s fields (time, FLOPs, bytes,
    intensity, achieved FLOP/s and bytes/s; with ``hw`` the prediction, MFU and MBU) over ``steps`` decode
    steps."""
    from forwardpass.sampling.params import SamplingParams

    core, layers = engine.core, engine.spec.layers
    rows = []
    for b in batch_sizes:
        if b > core.config.max_num_seqs:
            continue
        params = SamplingParams(max_tokens=steps + 2, ignore_eos=True, temperature=0.0)
        ids = [f"batching-{b}-{i}-{time.monotonic_ns()}" for i in range(b)]
        for rid in ids:
            engine.add_request(rid, prompt_ids, params)
        records: list[StepRecord] = []
        try:
            while engine.has_unfinished_requests() and len(records) < steps:
                engine.step()
                rec = core.stats[-1]
                # every copy decoding, no prompt chunk in the step
                if rec.num_prefill_tokens == 0 and rec.num_decode_tokens == b:
                    records.append(rec)
        finally:
            engine.abort(ids)
        if records:
            cost = step_cost(records, layers, hw, dtype_name, overhead)
            rate = b * len(records) / cost["time_s"] if cost["time_s"] else 0.0
            rows.append({"batch": b, "steps": len(records), "tokens_per_s": rate, **cost})
    return rows
