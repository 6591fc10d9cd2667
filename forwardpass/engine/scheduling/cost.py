"""FLOPs and bytes of one engine step, from the same ``ModelSpec`` the roofline analyzer reads.

Each step record carries these so measured time turns into achieved FLOP/s and GB/s (and MFU/MBU
against the analyzer's hardware table). The accounting is the analyzer's, per step rather than per
idealized batch: matmul FLOPs are 2 per active parameter per token, attention 4·head_dim·heads per
(query, key) pair, the LM head runs only on sampled rows; bytes are every weight read once per
forward (MoE: only the experts the step's tokens can touch, under uniform routing), plus K/V read
over each sequence's context and written for each new token, plus each sequence's fixed-size
state (Mamba / Gated DeltaNet layers) read and written once per step. Norms, activations and softmax are
left out (a few percent at most; ``forwardpass/analysis/roofline.py`` has the per-op version). Every count
comes from ``models/accounting.py``, the analyzer's too.

The engine core is handed a ``StepCost`` at construction (``None``: no accounting); it calls
``step(spans, num_sampled)`` once per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from forwardpass.models import accounting
from forwardpass.models.model_spec import ModelSpec


class StepCost(Protocol):
    def step(self, spans: Sequence[tuple[int, int]], num_sampled: int) -> tuple[float, float]: ...


class StepCostModel:
    def __init__(self, spec: ModelSpec, dtype_bytes: int, weight_bytes: float | None = None,
                 head_bytes: float | None = None, kv_dtype_bytes: int | None = None):  # fmt: skip
        """``dtype_bytes``: activations and KV cache; ``weight_bytes`` / ``head_bytes``: bytes per weight of
        the layers and of the LM head when they differ from it (quantized weights); ``kv_dtype_bytes``: the KV
        cache's when it differs (``kv_cache_dtype``)."""
        self.spec = s = spec
        self.dtype_bytes = dtype_bytes
        self.weight_bytes = dtype_bytes if weight_bytes is None else weight_bytes
        self.head_bytes = self.weight_bytes if head_bytes is None else head_bytes
        # parameters a token multiplies through, except embedding lookup, LM head and norms
        self.matmul_params = accounting.matmul_params(s)
        self.all_body_params = accounting.body_params(s)
        kv_bytes = dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
        self.kv_bytes_per_token = accounting.kv_bytes_per_token(s, kv_bytes)
        # Mamba / DeltaNet states: float32, per sequence
        self.state_bytes = accounting.state_bytes_per_sequence(s, 4)
        self.expert_params = accounting.expert_params(s)

    def step(self, spans: Sequence[tuple[int, int]], num_sampled: int) -> tuple[float, float]:
        """(FLOPs, bytes) of a forward pass over ``spans`` = [(tokens already cached, new tokens)]."""
        s = self.spec
        tokens = sum(n for _, n in spans)
        if tokens == 0:
            return 0.0, 0.0
        pairs = 0
        kv_read = 0.0
        for cached, n in spans:
            pairs += n * cached + n * (n + 1) // 2  # causal (query, key) pairs
            # averaged over layers: sliding layers see their window
            kv_read += accounting.kv_positions(s, cached + n)
        flops = 2.0 * self.matmul_params * tokens + 4.0 * s.attention_layers * s.q_dim * pairs
        flops += accounting.state_flops_per_token(s) * tokens
        flops += 2.0 * s.hidden * s.vocab * num_sampled
        body = float(self.all_body_params)
        if s.moe is not None and s.moe.layer_ids:  # experts no token of this step was routed to are not read
            untouched = s.moe.num_experts - accounting.unique_experts(s, tokens)
            body -= untouched * self.expert_params * s.moe_layers
        head = s.vocab * s.hidden if num_sampled else 0  # LM head (= embedding when tied)
        nbytes = (body * self.weight_bytes + head * self.head_bytes
                  + (kv_read + tokens) * self.kv_bytes_per_token)
        nbytes += 2 * self.state_bytes * len(spans)  # each sequence's state read once and written once
        return flops, float(nbytes)
