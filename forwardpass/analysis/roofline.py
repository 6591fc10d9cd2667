"""Per-operation FLOPs and bytes of a decoder-only LLM, from its config alone, against a device's roofline.

``analyze(config_or_path, hardware="h100", ...)`` returns a :class:`RooflineReport` with every operation
of one prefill (``prefill_tokens`` tokens, one sequence) and of one decode step at context ``context`` for
each batch size, their totals (TTFT, TPOT, tokens/s), the KV-cache size per token, the largest batch
that fits memory and the batch at which decode turns compute-bound.

Accounting assumptions (also listed in ``RooflineReport.assumptions``):

* **Weights** are read from memory once per forward pass, whatever the batch: a decode step at batch B
  reads every (active) weight once for all B sequences — that is why batching helps decode.
* **Activations round-trip memory between operations**: every op reads its inputs from and writes its
  outputs to memory (no cross-op fusion), except (a) RoPE and the KV-cache write are fused into the
  k/v projections, whose outputs go straight into the cache in the KV dtype, and (b) residual adds
  are fused into the following norm. Logits are written in fp32.
* **Attention** is fused (FlashAttention-style) by default: Q, K and V are read once, O written once,
  scores and probabilities never reach memory; causal prefill skips masked tiles (≈ P²/2 pairs).
  ``attention="naive"`` instead materialises S and P (written and read back, full P×P) and reads
  K/V once per query head.
* **KV traffic** uses ``num_key_value_heads``: a decode step at batch B and context L reads
  ``B·L·2·layers·kv_heads·head_dim·kv_bytes`` and writes one position per sequence; prefill writes
  P positions and reads them back once. Sliding-window layers read (and score) at most their window
  of positions; with some layers sliding and others not, L and the prefill pairs are layer averages.
* **State layers** (Mamba2, Gated DeltaNet; ``models/state_ops.py``) keep a float32 state per sequence,
  read and written once per pass whatever the context (counted as KV traffic), plus projections, a
  short conv and the scan (~6 / ~8 FLOPs per state value per token).
* **MoE**: routing is assumed uniform, so T tokens touch ``E·(1 − (1 − k/E)^T)`` distinct experts
  (k at T = 1); only those experts' weights are read and only k experts' FLOPs are spent per token.
* The **LM head** (2·hidden·vocab FLOPs per token) runs for the last position of each sequence only
  (as serving engines do), in prefill as in decode.
* **Not counted**: biases, RoPE arithmetic, quantization scales, sampling, kernel-launch and framework
  overhead, the memory needed for activations when sizing the largest batch.
* Each op takes ``max(flops / peak, bytes / bandwidth)``; ops run back to back, never overlapped.
  Matmuls use the dense matrix peak in the activation dtype, elementwise ops the FP32 vector rate.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forwardpass.analysis.dtypes import DTYPE_BYTES, normalize_dtype
from forwardpass.analysis.forward import ACT_FLOPS, LOGIT_BYTES, NORM_FLOPS, SOFTMAX_FLOPS, forward_ops
from forwardpass.analysis.hardware import Hardware, get_hardware
from forwardpass.analysis.presets import PRESETS
from forwardpass.errors import ConfigError, ModelNotFoundError
from forwardpass.models import accounting
from forwardpass.models.model_spec import ModelSpec, model_name
from forwardpass.op_cost import MATMUL, OpCost, StageTotals, json_number, totals

WEIGHT_DTYPES = ("fp32", "bf16", "fp16", "fp8", "int8", "int4")
ACT_DTYPES = ("fp32", "bf16", "fp16", "fp8", "int8")
KV_DTYPES = ("fp32", "bf16", "fp16", "fp8", "int8", "int4")

ATTENTION_OPS = ("attn_scores", "softmax", "attn_values")
__all__ = ["ACT_FLOPS", "LOGIT_BYTES", "NORM_FLOPS", "SOFTMAX_FLOPS", "analyze", "causal_pairs",
           "forward_ops", "prefill_pairs"]

ASSUMPTIONS = [
    "weights are read once per forward pass for the whole batch",
    (
        "activations round-trip memory between ops (no cross-op fusion); RoPE and the KV-cache write are "
        "fused into k/v_proj; residual adds into the norms"
    ),
    "attention '{attention}': {attention_note}",
    "KV read per decode step = batch x context x 2 x layers x kv_heads x head_dim x kv_bytes",
    "MoE routing uniform: T tokens touch E(1-(1-k/E)^T) experts; only k experts' FLOPs per token",
    "LM head (2 x hidden x vocab FLOPs) for the last position of each sequence only; logits in fp32",
    "not counted: biases, RoPE math, quantization scales, sampling, launch/framework overhead",
    (
        "op time = max(flops/peak, bytes/bandwidth); ops back to back; matmul peak in the activation dtype, "
        "elementwise ops at the fp32 vector rate"
    ),
    "largest batch: (memory budget - weights) / (KV bytes per sequence); activation memory ignored",
]
_ATTENTION_NOTES = {
    "fused": "Q, K, V read once, O written once, S and P stay on chip; causal prefill counts P(P+1)/2 pairs",
    "naive": "S and P (full P x P) written and read back; K and V read once per query head",
}


# Attention pairs and cache bytes: models/accounting.py (the engine's cost model counts
# with the same functions)
causal_pairs = accounting.causal_pairs
prefill_pairs = accounting.prefill_pairs


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------
@dataclass
class StageReport:
    """One prefill, or one decode step at one batch size."""

    stage: str
    batch: int
    tokens: int  # new tokens processed (prefill: prompt length × batch; decode: batch)
    context: int
    ops: list[OpCost]
    total: StageTotals

    @property
    def time_s(self) -> float:
        return self.total.time_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.time_s if self.time_s else math.inf

    @property
    def bound(self) -> str:
        return self.total.bound

    def to_dict(self) -> dict[str, Any]:
        t = self.total
        d: dict[str, Any] = {
            "batch": self.batch,
            "tokens": self.tokens,
            "context": self.context,
            "flops": t.flops,
            "bytes": t.bytes,
            "weight_bytes": t.weight_bytes,
            "act_bytes": t.act_bytes,
            "kv_read_bytes": t.kv_read_bytes,
            "kv_write_bytes": t.kv_write_bytes,
            "intensity": json_number(t.intensity),
            "compute_time_s": t.compute_time_s,
            "memory_time_s": t.memory_time_s,
            "time_s": t.time_s,
            "tokens_per_s": json_number(self.tokens_per_s),
            "bound": self.bound,
        }
        if self.stage == "prefill":
            d["ttft_s"] = t.time_s
        else:
            d["tpot_s"] = t.time_s
        return d


@dataclass
class RooflineReport:
    model: str
    shape: ModelSpec
    hardware: Hardware
    weight_dtype: str
    act_dtype: str
    kv_dtype: str
    attention: str
    prefill: StageReport
    decode: list[StageReport]
    kv_bytes_per_token: float
    memory_budget: float
    max_batch: int
    crossover_batch: int | None
    crossover_estimate: float  # ridge × bytes/weight / 2 (× experts / active experts for MoE)
    step_crossover_batch: int | None
    assumptions: list[str] = field(default_factory=list)

    @property
    def params(self) -> int:
        return self.shape.params

    @property
    def active_params(self) -> int:
        return self.shape.active_params

    @property
    def weight_bytes(self) -> float:
        """Bytes of all weights in the weight dtype (what must fit in memory)."""
        return self.shape.params * DTYPE_BYTES[self.weight_dtype]

    @property
    def ops(self) -> list[OpCost]:
        return [*self.prefill.ops, *(op for d in self.decode for op in d.ops)]

    @property
    def ridge(self) -> float:
        return self.hardware.ridge(self.act_dtype)

    def decode_at(self, batch: int) -> StageReport:
        for d in self.decode:
            if d.batch == batch:
                return d
        raise KeyError(f"no decode step for batch {batch}; have {[d.batch for d in self.decode]}")

    def to_dict(self) -> dict[str, Any]:
        s = self.shape
        return {
            "model": self.model,
            "architecture": s.architecture,
            "hardware": self.hardware.to_dict(self.act_dtype),
            "dtypes": {"weight": self.weight_dtype, "activation": self.act_dtype, "kv": self.kv_dtype},
            "attention": self.attention,
            "params": s.params,
            "active_params": s.active_params,
            "weight_bytes": self.weight_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "memory_budget": self.memory_budget,
            "max_batch": self.max_batch,
            "crossover_batch": self.crossover_batch,
            "crossover_estimate": self.crossover_estimate,
            "step_crossover_batch": self.step_crossover_batch,
            "prefill": self.prefill.to_dict(),
            "decode": [d.to_dict() for d in self.decode],
            "ops": [_op_dict(o) for o in self.ops],
            "assumptions": self.assumptions,
        }


def _op_dict(op: OpCost) -> dict[str, Any]:
    d = op.to_dict()
    keep = (
        "stage", "name", "kind", "count", "batch", "context", "flops", "bytes", "weight_bytes", "act_bytes",
        "kv_read_bytes", "kv_write_bytes", "intensity", "peak", "compute_time_s", "memory_time_s", "time_s",
        "bound",
    )  # fmt: skip
    return {k: d[k] for k in keep}


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------
def resolve_spec(config_or_path: Any) -> ModelSpec:
    """The spec (named for display) of a ``ModelSpec``, a config mapping, a preset name, a model dir or a
    config.json."""
    from forwardpass.loader.config import load_model_config

    if isinstance(config_or_path, ModelSpec):
        return config_or_path
    if isinstance(config_or_path, Mapping):  # named by its _name_or_path, else its architecture
        return ModelSpec.from_config(config_or_path)
    text = str(config_or_path)
    if text.lower() in PRESETS:
        return ModelSpec.from_config(PRESETS[text.lower()], text.lower())
    path = Path(os.path.expanduser(text))
    try:  # any name the commands take (forwardpass-default, smollm2, a .gguf file, a cached HF id)
        from forwardpass.registry import resolve_model

        path = resolve_model(text, download=False)
    except ModelNotFoundError:
        pass  # not a name: read as a path below, whose error lists the built-in shapes
    try:
        cfg = load_model_config(path)
    except ModelNotFoundError as exc:
        raise ModelNotFoundError(
            f"{exc.message}; or use a built-in shape: {', '.join(PRESETS)}", param="model"
        ) from exc
    return ModelSpec.from_config(cfg, model_name(path))


def _positive(name: str, value: int) -> int:
    try:
        v = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a positive integer, got {value!r}", param=name) from None
    if v <= 0 or v != value:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}", param=name)
    return v


def resolve_dtypes(
    hw: Hardware, weight_dtype: str | None, act_dtype: str | None, kv_dtype: str | None
) -> tuple[str, str, str]:
    """Defaults: weights bf16 (fp32 on this machine); activations follow float weights, else bf16/fp32;
    KV cache follows the activations."""
    base = hw.default_dtype
    w = normalize_dtype(weight_dtype or base, what="weight dtype", allowed=WEIGHT_DTYPES)
    if act_dtype:
        a = normalize_dtype(act_dtype, what="activation dtype", allowed=ACT_DTYPES)
    else:
        a = w if w in ("fp32", "bf16", "fp16") else base
    kv = normalize_dtype(kv_dtype or a, what="kv dtype", allowed=KV_DTYPES)
    return w, a, kv


def analyze(
    config_or_path: Any,
    hardware: str | Hardware = "h100",
    prefill_tokens: int = 2048,
    context: int = 4096,
    batches: Iterable[int] = (1, 8, 64),
    weight_dtype: str | None = None,
    act_dtype: str | None = None,
    kv_dtype: str | None = None,
    *,
    attention: str = "fused",
    memory_budget: float | None = None,
    prefill_batch: int = 1,
    remeasure: bool = False,
) -> RooflineReport:
    """Roofline analysis of a model (``ModelSpec``, config mapping, preset name, model dir or config.json)
    on a device.

    ``weight_dtype`` defaults to bf16 (fp32 on ``this-machine``); ``act_dtype`` to the weight dtype for
    float weights, else bf16 (fp32 on this machine); ``kv_dtype`` to ``act_dtype``. ``memory_budget``
    (bytes) defaults to 90% of the device's memory. ``context`` is the number of positions each
    sequence attends to during the decode step; ``prefill_batch`` sequences of ``prefill_tokens`` are
    prefilled together (one forward pass).
    """
    hw = get_hardware(hardware, remeasure=remeasure)
    shape = resolve_spec(config_or_path)
    name = shape.name
    w, a, kv = resolve_dtypes(hw, weight_dtype, act_dtype, kv_dtype)
    if attention not in _ATTENTION_NOTES:
        raise ConfigError(f"unknown attention {attention!r}; choose fused or naive", param="attention")
    prefill_tokens = _positive("prefill tokens", prefill_tokens)
    prefill_batch = _positive("prefill batch", prefill_batch)
    context = _positive("context", context)
    batches = [_positive("batch", b) for b in batches]
    if not batches:
        raise ConfigError("give at least one batch size", param="batch")
    wb, ab, kvb = DTYPE_BYTES[w], DTYPE_BYTES[a], DTYPE_BYTES[kv]
    common: dict[str, Any] = {"wb": wb, "ab": ab, "kvb": kvb, "attention": attention}

    def evaluated(ops: list[OpCost], ctx: int) -> list[OpCost]:
        for op in ops:
            op.context = ctx
            op.evaluate(hw, a)
        return ops

    # prefill: prefill_batch sequences of P tokens, each attending causally to itself
    pf_ops = evaluated(
        forward_ops(
            shape,
            "prefill",
            batch=prefill_batch,
            new_tokens=prefill_tokens,
            kv_len=prefill_tokens,
            pairs_per_seq=prefill_pairs(shape, prefill_tokens),
            **common,
        ),
        prefill_tokens,
    )
    prefill = StageReport(
        "prefill", prefill_batch, prefill_batch * prefill_tokens, prefill_tokens, pf_ops, totals(pf_ops)
    )

    L = accounting.kv_positions(shape, context)

    def decode_ops(b: int) -> list[OpCost]:
        ops = forward_ops(shape, "decode", batch=b, new_tokens=1, kv_len=L, pairs_per_seq=L, **common)
        return evaluated(ops, context)

    decode = []
    for b in batches:
        ops = decode_ops(b)
        decode.append(StageReport("decode", b, b, context, ops, totals(ops)))

    def linear_compute_bound(b: int) -> bool:
        t = totals([o for o in decode_ops(b) if o.kind == MATMUL and o.name not in ATTENTION_OPS])
        return t.compute_time_s >= t.memory_time_s

    def step_compute_bound(b: int) -> bool:
        t = totals(decode_ops(b))
        return t.compute_time_s >= t.memory_time_s

    kv_per_token = accounting.kv_bytes_per_token(shape, kvb)
    budget = float(memory_budget) if memory_budget is not None else 0.9 * hw.capacity
    free = budget - accounting.params(shape) * wb
    per_seq = accounting.cache_bytes_per_sequence(shape, context, kvb)  # KV grows with L; a state does not
    max_batch = max(0, int(free // per_seq)) if free > 0 and per_seq > 0 else 0

    notes = [s.format(attention=attention, attention_note=_ATTENTION_NOTES[attention]) for s in ASSUMPTIONS]
    if hw.compute_dtype(a) != a:
        notes.append(f"{hw.name} has no {a} matrix peak: matmuls counted at its {hw.compute_dtype(a)} peak")
    return RooflineReport(
        model=name,
        shape=shape,
        hardware=hw,
        weight_dtype=w,
        act_dtype=a,
        kv_dtype=kv,
        attention=attention,
        prefill=prefill,
        decode=decode,
        kv_bytes_per_token=kv_per_token,
        memory_budget=budget,
        max_batch=max_batch,
        crossover_batch=first_true(linear_compute_bound),
        crossover_estimate=hw.ridge(a)
        * wb
        / 2
        * (shape.moe.num_experts / shape.moe.experts_per_tok if shape.moe and shape.moe.layer_ids else 1),
        step_crossover_batch=first_true(step_compute_bound),
        assumptions=notes,
    )


def first_true(pred, limit: int = 1 << 20) -> int | None:
    """Smallest ``b`` in [1, limit] with ``pred(b)`` true, assuming ``pred`` is monotone; None if none."""
    hi = 1
    while not pred(hi):
        hi *= 2
        if hi > limit:
            return None
    lo = hi // 2  # pred(lo) is false (or lo == 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if pred(mid):
            hi = mid
        else:
            lo = mid
    return hi
