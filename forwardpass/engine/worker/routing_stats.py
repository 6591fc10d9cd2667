"""MoE routing statistics: the experts' token counts of each engine step, read from the model and recorded.

Each ``FusedMoE`` (``layers/moe.py``) keeps ``tokens_per_expert`` of its last forward as a tensor on the
model's device. The model runner reads all layers' counts in one host copy per step
(:class:`ModelRoutingCounter`, its ``RoutingCounter``) and returns them in its ``RunnerOutput``; the engine
core records them as a :class:`RoutingRecord` in :class:`RoutingStats` (``engine.routing_stats``, None for
dense models).
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass

import torch
from torch import nn

from forwardpass.layers.moe import moe_layers


@dataclass
class RoutingRecord:
    """Expert loads of one engine step (``step`` matches the step's ``StepRecord.step``)."""

    step: int
    num_tokens: int  # rows in the step's forward pass (prefill + decode)
    layers: list[int]  # decoder layer index of each MoE layer
    # [MoE layer][expert]: token assignments (each token counts top_k times)
    tokens_per_expert: list[list[int]]

    def to_dict(self) -> dict:
        return asdict(self)


def _device_of(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


class ModelRoutingCounter:
    """Reads every MoE layer's counts of the last forward in one host copy (the runner's
    ``RoutingCounter``)."""

    def __init__(self, model: nn.Module):
        self.layers = [moe for _, moe in moe_layers(model)]

    def collect(self) -> tuple[tuple[int, ...], ...]:
        counts = [m.tokens_per_expert if m.tokens_per_expert is not None
                  else torch.zeros(m.num_experts, dtype=torch.long, device=_device_of(m))
                  for m in self.layers]
        return tuple(tuple(row) for row in torch.stack(counts).tolist())


class RoutingStats(deque):
    """Per-step :class:`RoutingRecord`s of an engine (bounded like ``engine.stats``),
    filled by the engine core."""

    def totals(self) -> dict[int, list[int]]:
        """Decoder layer index → tokens per expert summed over the recorded steps."""
        out: dict[int, list[int]] = {}
        for rec in self:
            for layer, counts in zip(rec.layers, rec.tokens_per_expert):
                acc = out.setdefault(layer, [0] * len(counts))
                for e, c in enumerate(counts):
                    acc[e] += c
        return out

    def summary(self) -> str:
        """A per-layer table: assignments, busiest / idlest experts, imbalance (max / mean load)."""
        totals = self.totals()
        if not totals:
            return "routing: no MoE forward passes recorded"
        lines = [f"routing over {len(self)} steps ({sum(r.num_tokens for r in self)} tokens):",
                 f"{'layer':>5} {'assigned':>9} {'used':>6} {'max/mean':>9}  busiest experts (share)"]
        for layer, counts in sorted(totals.items()):
            total = sum(counts)
            mean = total / len(counts) if counts else 0
            used = sum(1 for c in counts if c)
            top = sorted(range(len(counts)), key=lambda e: -counts[e])[:3]
            busiest = ", ".join(f"{e} ({counts[e] / total:.0%})" for e in top if counts[e]) if total else "-"
            imbalance = max(counts) / mean if mean else 0.0
            lines.append(f"{layer:>5} {total:>9} {used:>3}/{len(counts):<2} {imbalance:>9.2f}  {busiest}")
        return "\n".join(lines)


def rank_loads(stats: RoutingStats, num_ranks: int) -> dict[int, list[int]]:
    """Decoder layer → token assignments each expert-parallel rank received (contiguous expert ranges,
    as ``layers/parallel_moe.py`` partitions the experts)."""
    out = {}
    for layer, counts in stats.totals().items():
        per = len(counts) // num_ranks
        out[layer] = [sum(counts[r * per : (r + 1) * per]) for r in range(num_ranks)]
    return out
