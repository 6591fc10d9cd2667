"""Predicted against measured: run the engine on this machine and compare with the roofline.

For each batch size B, with ``B`` distinct random prompts of ``prompt_tokens`` tokens (prefix caching off),
after one warm-up, ``runs`` times ``generate(prompts, max_tokens=N)``; medians over the runs of:

* with the engine's per-step records (``llm.engine.stats``: ``duration_s``, ``num_prefill_tokens``,
  ``num_decode_tokens``): prefill tokens/s = prompt tokens / time of the steps that prefill, decode
  tokens/s = decode tokens / time of the pure decode steps (method ``"step-stats"``);
* otherwise, wall time only: ``t1`` of ``generate(max_tokens=1)`` (prefill plus one LM head) and ``tN`` of
  ``generate(max_tokens=N)``; prefill tokens/s = ``B·P / t1``, decode tokens/s = ``B·(N − 1) / (tN − t1)``
  (method ``"wall-difference"``).

The prediction is :func:`~forwardpass.analysis.roofline.analyze` on ``this-machine`` for the same model,
batch, dtype and the mean decode context ``P + N/2``. The ratio measured / predicted is the fraction of
the roofline the engine reaches (≤ 1 unless the model's assumptions are pessimistic).
"""

from __future__ import annotations

import importlib.util
import random
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forwardpass.analysis.roofline import RooflineReport, analyze, resolve_dtypes
from forwardpass.errors import ConfigError, ForwardpassError, ModelNotFoundError

_ENGINE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class EngineUnavailableError(ForwardpassError):
    """``--measure`` needs the engine (``forwardpass.llm``), which this installation lacks."""

    error_type = "engine_unavailable"
    status_code = 501


@dataclass
class MeasureResult:
    model: str
    rows: list[dict[str, Any]]  # {batch, metric, predicted, measured, ratio}
    reports: dict[int, RooflineReport] = field(default_factory=dict)
    timings: dict[int, dict[str, Any]] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)  # what was run: stated under the table

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "rows": self.rows, "timings": self.timings, "settings": self.settings}


def _engine_factory() -> Callable[..., Any]:
    if importlib.util.find_spec("forwardpass.llm") is None:
        raise EngineUnavailableError(
            "--measure runs the engine, but forwardpass.llm is not available in this installation; "
            "drop --measure to get the prediction alone"
        )
    from forwardpass.llm import LLM

    return LLM


def _sampling_params(max_tokens: int) -> Any:
    from forwardpass.sampling.params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)


def _generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> float:
    params = _sampling_params(max_tokens)
    t0 = time.perf_counter()
    try:
        llm.generate(prompts, params, use_tqdm=False)
    except TypeError:  # an LLM without the use_tqdm keyword
        llm.generate(prompts, params)
    return time.perf_counter() - t0


def measure(
    model: str | Path,
    *,
    batches: Iterable[int] = (1,),
    prompt_tokens: int = 128,
    new_tokens: int = 32,
    runs: int = 3,
    weight_dtype: str | None = None,
    hardware: Any = "this-machine",
    remeasure: bool = False,
    llm_factory: Callable[..., Any] | None = None,
    engine_kwargs: dict[str, Any] | None = None,
    overhead: Any = "this-machine",
) -> MeasureResult:
    """Time the engine on ``model`` (a model directory with weights) and compare with the roofline.

    ``overhead`` (``"this-machine"``, an ``analysis.overhead.Overhead`` or None) is added to each predicted
    step: the third bound (see ``analysis/overhead.py``)."""
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelNotFoundError(
            f"--measure needs a model directory with weights, got {str(model)!r} "
            "(presets and bare config.json files have no weights to run)",
            param="model",
        )
    if new_tokens < 2:
        raise ConfigError("--measure needs at least 2 new tokens to time decode", param="new_tokens")
    if runs < 1 or prompt_tokens < 1:
        raise ConfigError("--measure needs runs >= 1 and a prompt of at least one token", param="runs")
    batches = sorted({int(b) for b in batches})

    from forwardpass.analysis.hardware import get_hardware

    hw = get_hardware(hardware, remeasure=remeasure)
    w, _, _ = resolve_dtypes(hw, weight_dtype, None, None)
    if w not in _ENGINE_DTYPES:
        raise ConfigError(
            f"--measure runs the engine, which loads weights as fp32, bf16 or fp16, not {w}",
            param="weight_dtype",
        )
    factory = llm_factory or _engine_factory()

    from forwardpass.models.model_spec import load_model_spec

    spec = load_model_spec(path)
    kv_per_token = spec.kv_bytes_per_token(4)  # fp32 at most
    tokens_needed = max(batches) * (prompt_tokens + new_tokens + 16)
    kwargs = {
        "dtype": _ENGINE_DTYPES[w],
        "enable_prefix_caching": False,
        "max_num_seqs": max(batches),
        "max_num_batched_tokens": max(2048, max(batches) * prompt_tokens),
        "kv_cache_memory": max(1 << 28, int(1.25 * kv_per_token * tokens_needed)),
        "max_model_len": prompt_tokens + new_tokens + 16,
        "cpu_kernels": True,  # measure the engine's fast path, waiting for a first-time kernel build
    }
    kwargs.update(engine_kwargs or {})
    llm = factory(model=str(path), **kwargs)

    vocab = spec.vocab
    rng = random.Random(0)

    def prompts(b: int) -> list[list[int]]:  # fresh, distinct prompts each call: nothing to reuse
        return [[rng.randrange(3, vocab) for _ in range(prompt_tokens)] for _ in range(b)]

    from forwardpass.analysis.overhead import resolve_overhead, stage_with_overhead

    oh = resolve_overhead(overhead)
    oh_s = oh.time_s(spec.layers) if oh is not None else 0.0
    result = MeasureResult(model=path.name, rows=[])
    result.settings = {
        "hardware": hw.label, "batches": batches, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
        "runs": runs, "weight_dtype": w,
        "engine": {k: v for k, v in kwargs.items() if k != "kv_cache_memory"},
        "overhead": oh.to_dict() if oh is not None else None, "overhead_per_step_s": oh_s,
    }
    stats = getattr(getattr(llm, "engine", None), "stats", None)
    for b in batches:
        _generate(llm, prompts(b), 2)  # warm-up
        if stats is not None and hasattr(stats, "clear"):
            method = "step-stats"
            pre, dec = [], []
            for _ in range(runs):
                stats.clear()
                _generate(llm, prompts(b), new_tokens)
                steps = list(stats)
                pf = [r for r in steps if r.num_prefill_tokens]
                dc = [r for r in steps if r.num_decode_tokens and not r.num_prefill_tokens]
                pre.append(sum(r.num_prefill_tokens for r in pf) / sum(r.duration_s for r in pf))
                dec.append(sum(r.num_decode_tokens for r in dc) / sum(r.duration_s for r in dc))
            prefill_tps, decode_tps = statistics.median(pre), statistics.median(dec)
            timing: dict[str, Any] = {"method": method, "prefill_tok_s_runs": pre, "decode_tok_s_runs": dec}
        else:
            method = "wall-difference"
            t1 = statistics.median(_generate(llm, prompts(b), 1) for _ in range(runs))
            tn = statistics.median(_generate(llm, prompts(b), new_tokens) for _ in range(runs))
            decode_s = max(tn - t1, 1e-9)
            prefill_tps, decode_tps = b * prompt_tokens / t1, b * (new_tokens - 1) / decode_s
            timing = {"method": method, "prefill_s": t1, "generate_s": tn, "decode_s": decode_s}
        rep = analyze(
            spec,
            hw,
            prefill_tokens=prompt_tokens,
            prefill_batch=b,
            context=prompt_tokens + new_tokens // 2,
            batches=(b,),
            weight_dtype=w,
        )
        result.reports[b] = rep
        result.timings[b] = {
            **timing,
            "new_tokens": new_tokens,
            "prompt_tokens": prompt_tokens,
            "tpot_s": b / decode_tps,
            "predicted_tpot_s": rep.decode[0].time_s + oh_s,
        }
        measured = {"prefill tok/s": prefill_tps, "decode tok/s": decode_tps}
        stages = {"prefill tok/s": rep.prefill, "decode tok/s": rep.decode[0]}
        for metric, m in measured.items():
            st = stages[metric]
            t, bound = stage_with_overhead(st.time_s, st.bound, oh_s)
            p = st.tokens / t
            result.rows.append(
                {"batch": b, "metric": metric, "predicted": p, "measured": m, "ratio": m / p if p else None,
                 "roofline_only": st.tokens_per_s, "bound": bound}
            )
    return result
