"""What the live dashboard shows, collected from the engine's step records and finished requests.

``DashboardState`` is fed like the Prometheus metrics: ``AsyncLLMEngine.stat_listeners`` (each step's
``StepRecord``) and ``finish_listeners`` (TTFT / TPOT of each request). Rates are over a sliding window
of wall time, so they fall back to zero when the engine goes idle. Achieved FLOP/s and bytes/s come
from the records' cost accounting (``engine/scheduling/cost.py``); MFU and MBU divide them by the hardware's
peaks (:func:`device_peaks`), and the overhead measured by ``forwardpass roofline --measure`` (when cached)
gives the third bound.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from forwardpass.analysis.oversubscription import (
    OversubscriptionWatch,
    oversubscribed,
    warning_logged,
    warning_text,
)
from forwardpass.analysis.regime import classify

if TYPE_CHECKING:
    from forwardpass.engine.frontend.async_engine import AsyncLLMEngine, RequestTiming
    from forwardpass.engine.frontend.outputs import RequestOutput
    from forwardpass.engine.scheduling.stats import StepRecord

logger = logging.getLogger(__name__)

WINDOW_S = 2.0  # tok/s and FLOP/s are averaged over the steps that ended this recently
HISTORY = 120  # steps kept for the batch-mix and roofline charts


def token_bucket(tokens: int) -> int:
    """The batching chart's bucket of a step that computed ``tokens`` tokens: the next power of two (1, 2, 4,
    ..., 256, ...), so a 16-sequence decode step and a 256-token prefill chunk land in their own columns."""
    return 1 << max(0, tokens - 1).bit_length()


@dataclass(frozen=True)
class Peaks:
    name: str
    flops: float  # matmul peak FLOP/s in the engine's dtype
    bandwidth: float  # bytes/s
    per_step_s: float | None = None  # measured overhead, when cached
    per_layer_s: float | None = None


def device_peaks(device: str, dtype: str = "fp32") -> Peaks | None:
    """Peaks of the serving device without measuring anything (the server must start fast).

    CUDA: the spec-table entry whose name the device name contains (``NVIDIA H100 80GB HBM3`` → h100).
    CPU: the cached ``this-machine`` measurement, if ``forwardpass roofline --hardware this-machine`` ran.
    """
    try:
        import json

        from forwardpass.analysis.hardware import SPECS, THIS_MACHINE, cache_path, hardware_from_measurement

        doc: dict[str, Any] = {}
        if cache_path().is_file():
            doc = json.loads(cache_path().read_text())
        hw = None
        if device.startswith("cuda"):  # the driver's name for it, without initializing CUDA here
            from pathlib import Path

            infos = Path("/proc/driver/nvidia/gpus").glob("*/information")
            name = " ".join(p.read_text() for p in infos).lower()
            # the longest matching key first: an "L40S" also contains "l4"
            hw = next((SPECS[k] for k in sorted(SPECS, key=len, reverse=True) if k.split("-")[0] in name),
                      None)
        elif isinstance(doc.get(THIS_MACHINE), dict):
            hw = hardware_from_measurement(doc[THIS_MACHINE])
        if hw is None:
            return None
        oh = doc.get(f"overhead-{device.split(':')[0]}") or {}
        return Peaks(hw.name, hw.peak(dtype), hw.bandwidth, oh.get("per_step_s"), oh.get("per_layer_s"))
    except Exception as exc:  # noqa: BLE001 - the dashboard works without peaks
        logger.warning("no hardware peaks for the dashboard: %s", exc)
        return None


def _device_dtype(engine: AsyncLLMEngine) -> tuple[str, str]:
    kwargs = engine.spec.config_kwargs
    device = str(kwargs.get("device", "cpu"))
    dtype = str(kwargs.get("dtype", "auto"))
    dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)
    if dtype == "auto":
        dtype = "bf16" if device.startswith("cuda") else "fp32"
    return device, dtype


def engine_peaks(engine: AsyncLLMEngine) -> Peaks | None:
    """The peaks of the engine's device and dtype, from its recipe (known before the engine starts)."""
    device, dtype = _device_dtype(engine)
    return device_peaks(device, dtype)


def engine_layers(engine: AsyncLLMEngine) -> int | None:
    """The layer count of the engine's model, from the spec its info carries (None until it has started)."""
    info = getattr(engine, "info", None)
    spec = getattr(info, "model_spec", None)
    return spec.layers if spec is not None else None


def engine_watch(engine: AsyncLLMEngine, layers: int | None) -> OversubscriptionWatch | None:
    """The oversubscription judge of ``analysis/oversubscription.py`` for this engine (None without layers);
    silent itself: the dashboard only shows what it finds."""
    if not layers:
        return None
    device, dtype = _device_dtype(engine)
    return OversubscriptionWatch(layers, dtype, device=device.split(":")[0])


class DashboardState:
    def __init__(self, engine: AsyncLLMEngine, peaks: Peaks | None = None, layers: int | None = None,
                 watch: OversubscriptionWatch | None = None) -> None:
        """``layers`` (and the ``watch`` it sizes) not given: the model's, once the engine has started."""
        self.engine, self.peaks, self.layers, self.watch = engine, peaks, layers, watch
        self._model_known = layers is not None
        self.steps: deque[tuple[float, StepRecord]] = deque(maxlen=HISTORY)  # (received at, record)
        self.ttft: deque[float] = deque(maxlen=100)
        self.tpot: deque[float] = deque(maxlen=100)
        self.finished = 0
        # every step since the server started, by tokens computed (token_bucket): [steps, FLOPs, bytes,
        # seconds]
        self.by_tokens: dict[int, list[float]] = {}
        engine.stat_listeners.append(self.on_step)
        engine.finish_listeners.append(self.on_finish)

    def on_step(self, record: StepRecord) -> None:
        self.steps.append((time.monotonic(), record))
        tokens = record.num_prefill_tokens + record.num_decode_tokens
        if tokens and record.duration_s > 0:
            acc = self.by_tokens.setdefault(token_bucket(tokens), [0, 0.0, 0.0, 0.0])
            acc[0] += 1
            acc[1] += record.flops
            acc[2] += record.bytes
            acc[3] += record.duration_s

    def batching(self) -> list[dict[str, float]]:
        """Achieved FLOP/s and bytes/s by tokens per step (token_bucket), over every step so far: what
        batching does to arithmetic intensity, measured — a step of more tokens reads the same weights for
        more work."""
        return [{"tokens": b, "steps": n, "flops_per_s": f / t, "bytes_per_s": by / t,
                 "intensity": f / by if by else 0.0, "ms_per_step": 1e3 * t / n}
                for b, (n, f, by, t) in sorted(self.by_tokens.items())]

    def on_finish(self, out: RequestOutput, timing: RequestTiming) -> None:
        self.finished += 1
        if timing.first_token is not None:
            self.ttft.append(timing.first_token - timing.arrival)
        if timing.itl:
            self.tpot.append(sum(timing.itl) / len(timing.itl))

    def _know_model(self) -> None:
        """The layer count and the oversubscription watch, from the engine's info once it has started (the
        dashboard is built before)."""
        if self._model_known:
            return
        self.layers = engine_layers(self.engine)
        if self.layers is not None:
            self._model_known = True
            self.watch = self.watch or engine_watch(self.engine, self.layers)

    def _terms(self, r: StepRecord) -> dict[str, float] | None:
        self._know_model()
        p = self.peaks
        if p is None:
            return None
        terms = {"compute": r.flops / p.flops, "memory": r.bytes / p.bandwidth}
        if p.per_step_s is not None:
            terms["overhead"] = p.per_step_s + (p.per_layer_s or 0.0) * (self.layers or 0)
        return terms

    def bound(self, r: StepRecord) -> str | None:
        """The bound the prediction gives the step (its largest term)."""
        terms = self._terms(r)
        if terms is None or not r.duration_s:
            return None
        return max(terms, key=lambda k: terms[k])

    def regime(self, r: StepRecord) -> dict[str, Any]:
        """Measured against predicted time and the regime (``analysis/regime.py``): the predicted bound, or
        ``overhead`` when the step took more than 3x its prediction — what ``explain --json`` gives a step."""
        terms = self._terms(r)
        if terms is None or not r.duration_s:
            return {"predicted_s": None, "ratio": None, "regime": None}
        predicted = max(terms["compute"], terms["memory"]) + terms.get("overhead", 0.0)
        c = classify(r.duration_s, predicted, max(terms, key=lambda k: terms[k]))
        return {"predicted_s": c.predicted_s, "ratio": c.ratio, "regime": c.regime}

    def oversubscription(self, records: list[StepRecord]) -> dict[str, Any] | None:
        """The oversubscription judgement over the recent steps, with the warning when it fires (now, or
        once logged by this process); None without a prediction for this machine."""
        logged = warning_logged()
        self._know_model()
        judged = self.watch.judge(records) if self.watch is not None else None
        if judged is None and logged is None:
            return None
        warning = logged
        if oversubscribed(judged):
            from forwardpass.threads import usable_cores

            warning = warning_text(judged, self.engine.spec.num_threads or usable_cores())  # type: ignore[arg-type]
        return {**(judged or {}), "warning": warning}

    def snapshot(self) -> dict[str, Any]:
        """The numbers of the page (without the block map, which the engine is asked for)."""
        now = time.monotonic()
        snap = self.engine.snapshot
        recent = [r for t, r in self.steps if now - t <= WINDOW_S]
        busy = sum(r.duration_s for r in recent)
        span = WINDOW_S
        last = self.steps[-1][1] if self.steps else None
        idle = not recent
        p = self.peaks
        flops_s = sum(r.flops for r in recent) / busy if busy else 0.0
        bytes_s = sum(r.bytes for r in recent) / busy if busy else 0.0
        info = self.engine.info
        return {
            "time": now,
            "requests_running": snap.num_running,
            "requests_waiting": snap.num_waiting,
            "requests_finished": self.finished,
            "kv_blocks_total": info.num_blocks if info else 0,
            "kv_blocks_used": (info.num_blocks - snap.num_free_blocks) if info else 0,
            "kv_usage": snap.kv_usage,
            "tokens_per_s": sum(r.num_sampled for r in recent) / span,
            "prefill_tokens_per_s": sum(r.num_prefill_tokens for r in recent) / span,
            "ttft_s": sum(self.ttft) / len(self.ttft) if self.ttft else None,
            "tpot_s": sum(self.tpot) / len(self.tpot) if self.tpot else None,
            "preemptions": last.total_preemptions if last else 0,
            "prefix_cache_hit_rate": last.prefix_cache_hit_rate if last else 0.0,
            "spec_decode": spec_decode(recent),  # speculative decoding over the window; None without drafts
            "achieved_flops_per_s": flops_s,
            "achieved_bytes_per_s": bytes_s,
            "mfu": flops_s / p.flops if p and not idle else None,
            "mbu": bytes_s / p.bandwidth if p and not idle else None,
            "hardware": None if p is None else {"name": p.name, "peak_flops": p.flops,
                                                "bandwidth": p.bandwidth, "per_step_s": p.per_step_s,
                                                "per_layer_s": p.per_layer_s},
            "steps": [
                {"step": r.step, "age_s": now - t, "prefill": r.num_prefill_tokens,
                 "decode": r.num_decode_tokens, "duration_s": r.duration_s, "flops": r.flops,
                 "bytes": r.bytes, "intensity": r.flops / r.bytes if r.bytes else 0.0,
                 "flops_per_s": r.achieved_flops_per_s, "bound": self.bound(r), **self.regime(r)}
                for t, r in list(self.steps)[-60:]
            ],
            "oversubscription": self.oversubscription([r for _, r in self.steps]),
            "batching": self.batching(),
        }


def spec_decode(records: list[StepRecord]) -> dict[str, Any] | None:
    """Drafts verified and accepted in ``records``, the acceptance rate and the mean acceptance length
    (tokens a verifying sequence emitted per step); None when no step verified drafts."""
    drafts = sum(r.num_draft_tokens for r in records)
    if not drafts:
        return None
    accepted = sum(r.num_accepted_tokens for r in records)
    lengths = [n for r in records for n in r.acceptance_lengths]
    return {"drafts": drafts, "accepted": accepted, "acceptance_rate": accepted / drafts,
            "mean_acceptance_length": sum(lengths) / len(lengths) if lengths else None}
