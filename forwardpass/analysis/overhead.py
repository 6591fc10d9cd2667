"""The third bound: fixed per-step and per-layer overhead, measured on this machine.

Compute (FLOPs / peak) and memory (bytes / bandwidth) are the roofline's two bounds. A small model at
small batch reaches neither: each engine step pays a fixed cost (scheduling, building the batch's
tensors, sampling, Python) and each layer a few more (kernel launches or, on CPU, operator dispatch),
however little arithmetic the layer does. This module measures both on the machine and adds them to the
prediction::

    predicted step time = max(compute, memory) + per_step + layers × per_layer

and names the bound by the largest of the three terms: ``compute``, ``memory`` or ``overhead``.

Measurement (:func:`measure_overhead`): two random-weight decoders of negligible width (hidden 64, vocab
256) with 1 and ``deep_layers`` layers run pure decode steps through the real engine (batch 1, greedy),
interleaved, ``repeats`` times; the step time of each is the median of its fastest quarter of steps, best
over the repeats (load from elsewhere only ever adds time). t₁ and t_L give
``per_layer = (t_L − t₁)/(L − 1)`` and ``per_step = t₁ − per_layer``. Their arithmetic and bytes are
microseconds at most, so what remains is overhead. The result is cached next to the ``this-machine``
measurement (``hardware.cache_path()``) under ``overhead-<device>``.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import logging
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

BOUNDS = ("compute", "memory", "overhead")


@dataclass(frozen=True)
class Overhead:
    per_step_s: float
    per_layer_s: float
    device: str = "cpu"
    method: str = ""
    measured_at: str | None = None

    def time_s(self, layers: int) -> float:
        return self.per_step_s + self.per_layer_s * layers

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class StepPrediction:
    compute_s: float
    memory_s: float
    overhead_s: float

    @property
    def time_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.overhead_s

    @property
    def bound(self) -> str:
        terms = {"compute": self.compute_s, "memory": self.memory_s, "overhead": self.overhead_s}
        return max(terms, key=lambda k: terms[k])

    def to_dict(self) -> dict[str, Any]:
        return {"compute_s": self.compute_s, "memory_s": self.memory_s, "overhead_s": self.overhead_s,
                "predicted_s": self.time_s, "bound": self.bound}


def predict_step(flops: float, nbytes: float, layers: int, peak_flops: float, bandwidth: float,
                 overhead: Overhead | None) -> StepPrediction:
    """The three-term prediction of one step with ``flops`` and ``nbytes`` through ``layers`` layers."""
    return StepPrediction(
        compute_s=flops / peak_flops if peak_flops else 0.0,
        memory_s=nbytes / bandwidth if bandwidth else 0.0,
        overhead_s=overhead.time_s(layers) if overhead is not None else 0.0,
    )


def _tiny_step_time(layers: int, device: str, steps: int) -> float:
    """Median pure-decode step time of a random decoder with ``layers`` layers and negligible width."""
    import torch

    from forwardpass.assets import default_llm_path
    from forwardpass.config import EngineConfig
    from forwardpass.engine.builder import build_engine_core
    from forwardpass.engine.frontend.llm_engine import LLMEngine
    from forwardpass.models.llama import LlamaForCausalLM
    from forwardpass.models.model_spec import load_model_spec
    from forwardpass.models.prepare import process_weights_after_loading
    from forwardpass.plan import building_with_plan
    from forwardpass.sampling.params import SamplingParams

    # The probe is the embedded model's spec shrunk to nothing but its layers (no config keys are read
    # here: only models/model_spec.py does that); its directory supplies tokenizer and generation config.
    home = default_llm_path()
    base = load_model_spec(home)
    spec = dataclasses.replace(base, name=f"overhead-probe-{layers}", hidden=64, intermediate=128, heads=2,
                               kv_heads=1, head_dim=32, layers=layers, vocab=256, tied=True,
                               layer_windows=(None,) * layers)

    def build(plan):
        torch.manual_seed(0)
        with building_with_plan(plan):
            net = LlamaForCausalLM(spec).to(device)
        with torch.no_grad():
            for p in net.parameters():
                p.normal_(0.0, 0.02)
        process_weights_after_loading(net)
        return net, spec

    # the engine's compiled CPU path, as the engines it is compared with (explain/measure.py) run: with it a
    # decode step's layers are one C++ call (models/llama_decode_stack.py), so its per-layer
    # cost is the kernels' own
    config = EngineConfig(device=device, num_kv_blocks=64, enable_prefix_caching=False, cpu_kernels=True)
    core = build_engine_core(home, config, model_builder=build)
    engine = LLMEngine(home, core=core)
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    for rid in ("warm", "run"):
        core.stats.clear()
        engine.add_request(rid, [2, 3, 4, 5], params)
        while engine.has_unfinished_requests():
            engine.step(only_finished=True)
    times = [r.duration_s for r in core.stats if r.num_decode_tokens and not r.num_prefill_tokens]
    # the fastest steps: other load on the machine only ever adds time (like the hardware
    # microbenchmark's best-of)
    times.sort()
    return statistics.median(times[: max(1, len(times) // 4)])


#: what the probe engines run on: part of each measurement's ``method``, so a cached one taken on another path
#: (before the compiled CPU path and the decode stack, the module path's ~0.5 ms per layer) is measured again
PATH = "engine's compiled CPU path"


def measure_overhead(device: str = "cpu", *, deep_layers: int = 8, steps: int = 48,
                     repeats: int = 2) -> Overhead:
    t1, tl = float("inf"), float("inf")
    for _ in range(repeats):  # interleaved, best of each: load from elsewhere only ever adds time
        t1 = min(t1, _tiny_step_time(1, device, steps))
        tl = min(tl, _tiny_step_time(deep_layers, device, steps))
    per_layer = max(0.0, (tl - t1) / (deep_layers - 1))
    return Overhead(
        per_step_s=max(0.0, t1 - per_layer),
        per_layer_s=per_layer,
        device=device,
        method=(f"median of the fastest quarter of pure-decode engine steps of random decoders (hidden 64, "
                f"vocab 256) with 1 and {deep_layers} layers, batch 1, {steps} steps, best of {repeats} "
                f"interleaved runs, {PATH}"),
        measured_at=_dt.datetime.now().isoformat(timespec="seconds"),
    )


def this_machine_overhead(device: str = "cpu", *, remeasure: bool = False,
                          path: Path | None = None) -> Overhead:
    """The measured overhead of ``device`` on this machine, from the cache unless missing or ``remeasure``."""
    from forwardpass.analysis.hardware import cache_path

    path = path or cache_path()
    key = f"overhead-{device}"
    doc: dict[str, Any] = {}
    if path.is_file():
        try:
            doc = json.loads(path.read_text())
            cached = doc.get(key)
            if not remeasure and isinstance(cached, dict) and str(cached.get("method", "")).endswith(PATH):
                return Overhead(**cached)
        except (ValueError, OSError, TypeError) as exc:
            log.warning("ignoring unreadable overhead cache %s: %s", path, exc)
            doc = {}
    log.info("measuring per-step and per-layer overhead on %s; cached in %s", device, path)
    oh = measure_overhead(device)
    if not isinstance(doc, dict):
        doc = {}
    doc[key] = oh.to_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".overhead.tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    tmp.replace(path)
    return oh


def stage_with_overhead(stage_time_s: float, stage_bound: str, overhead_s: float) -> tuple[float, str]:
    """A roofline stage's predicted time with the overhead added, and its bound (``overhead`` where the
    fixed costs exceed the roofline time of the work itself)."""
    return stage_time_s + overhead_s, ("overhead" if overhead_s > stage_time_s else stage_bound)


def resolve_overhead(overhead: Any, device: str = "cpu") -> Overhead | None:
    """``"this-machine"`` (measured once, cached), an :class:`Overhead`, or None."""
    if overhead == "this-machine":
        return this_machine_overhead(device)
    return overhead


def measured_points(result: Any) -> list[Any]:
    """Plot points of a ``measure()`` result: per batch, the prefill and decode stage as predicted
    (roofline + overhead) and as measured, at the stage's arithmetic intensity."""
    from forwardpass.analysis.plot import Point

    pts = []
    for row in result.rows:
        rep = result.reports[row["batch"]]
        stage = rep.prefill if row["metric"].startswith("prefill") else rep.decode[0]
        t = stage.total
        ai = t.flops / t.bytes if t.bytes else 0.0
        if ai <= 0:
            continue
        tokens = stage.tokens
        name = f"{'prefill' if stage is rep.prefill else 'decode'} b={row['batch']}"
        pts.append(Point(f"{name} predicted", ai, t.flops * row["predicted"] / tokens, "predicted",
                         "predicted (roofline + overhead)", True))
        pts.append(Point(f"{name} measured", ai, t.flops * row["measured"] / tokens, "measured", "measured",
                         True))
    return pts


def overhead_rows(report: Any, overhead: Overhead) -> list[dict[str, Any]]:
    """Each stage of a ``RooflineReport`` with the overhead added: the three-term prediction and bound."""
    oh_s = overhead.time_s(report.shape.layers)
    rows = []
    for st in [report.prefill, *report.decode]:
        t, bound = stage_with_overhead(st.time_s, st.bound, oh_s)
        rows.append({"stage": st.stage, "batch": st.batch, "roofline_s": st.time_s, "overhead_s": oh_s,
                     "time_s": t, "tokens_per_s": st.tokens / t if t else 0.0, "bound": bound})
    return rows
