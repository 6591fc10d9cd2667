"""Mixture of experts: a router picks ``top_k`` of ``E`` gated MLPs for each token; their outputs are
combined with the router's weights. A model with 16 experts and top-2 reads (at batch 1) the
attention weights plus 2/16 of the expert weights per token: it costs like a much smaller dense model.

Two implementations behind one interface (``FusedMoE.impl``):

* ``"grouped"`` (the fast path): the ``T × top_k`` (token, expert) assignments are sorted by expert,
  the tokens gathered once into expert order, then **one matmul pair per active expert** over its
  contiguous slice, and one weighted ``index_add_`` scatters the results back to their tokens. The
  Python loop is over experts that received tokens, never over tokens.
* ``"reference"``: a plain loop over tokens and their chosen experts; the oracle the fast path is
  tested against (``tests/test_moe.py``).

Expert weights are stacked, ``gate_up_proj [E, 2·I, H]`` (gate rows then up rows, so one matmul
gives both) and ``down_proj [E, H, I]``, the layout transformers 5 keeps in memory. Checkpoints written
by ``save_pretrained`` store one tensor per expert (``experts.{e}.gate_proj.weight`` or Mixtral's
``w1/w3/w2``); :func:`load_moe_weights` copies them into the stacks (a checkpoint already holding the
stacked tensors is read directly).

Routing is observable: each ``FusedMoE`` keeps ``tokens_per_expert`` of its last forward as a tensor;
the model runner reads all layers' counts in one host copy per step (:class:`ModelRoutingCounter`)
and returns them in its ``RunnerOutput``; the engine core records them in :class:`RoutingStats`
(``engine.routing_stats``, None for dense models). The grouped CPU path itself needs the counts on
the host to slice its sorted tokens per expert; a fused GPU kernel would not.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from forwardpass.errors import WeightShapeError
from forwardpass.layers.activation import get_activation, silu_and_mul
from forwardpass.layers.linear import Linear, linear
from forwardpass.plan import current_plan
from forwardpass.quant.weight import QuantizedWeight


# ----- routing ------------------------------------------------------------------------------------
def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts (in fp32), keep the ``top_k`` largest, optionally renormalize them.

    Returns ``(weights [T, k] fp32, expert ids [T, k] int64)``. Qwen3-MoE renormalizes when
    ``norm_topk_prob``; Mixtral always does, which equals softmax over the chosen experts' logits.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


# ----- expert computation -------------------------------------------------------------------------
def grouped_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    act: Callable = F.silu, counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sort (token, expert) pairs by expert → one matmul pair per active expert → weighted scatter-add.

    ``x [T, H]``, ``gate_up [E, 2I, H]``, ``down [E, H, I]``, ``weights``/``ids [T, k]``; ``counts [E]``
    (assignments per expert) if the caller has them already.
    """
    k = ids.shape[1]
    flat = ids.reshape(-1)
    if counts is None:
        counts = torch.bincount(flat, minlength=gate_up.shape[0])
    sizes = counts.tolist()  # host copy: the loop below slices the sorted tokens per expert
    order = torch.argsort(flat, stable=True)  # assignment positions, grouped by expert
    token_of = order // k  # the token each sorted assignment belongs to
    xs = x.index_select(0, token_of)  # [T·k, H], contiguous per expert
    outs = []
    start = 0
    for e, n in enumerate(sizes):
        if n == 0:
            continue
        h = silu_and_mul(linear(xs[start : start + n], gate_up[e]), act)
        outs.append(linear(h, down[e]))
        start += n
    y = torch.cat(outs) if len(outs) > 1 else outs[0]
    y = y * weights.reshape(-1)[order].to(y.dtype).unsqueeze(1)
    out = torch.zeros_like(x)
    out.index_add_(0, token_of, y)
    return out


def reference_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    act: Callable = F.silu, counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The plain per-token definition: ``out[t] = Σ_j w[t, j] · expert_{ids[t, j]}(x[t])``."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = silu_and_mul(F.linear(x[t], gate_up[e]), act)
            out[t] += weights[t, j].to(x.dtype) * F.linear(h, down[e])
    return out


EXPERT_IMPLS = {"grouped": grouped_experts, "reference": reference_experts}


class ExpertWeights(nn.Module):
    """The stacked weights of all experts of one layer (a module so names read ``mlp.experts.*``)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)
        plan = current_plan()  # the experts take the projections' block format when the plan quantizes
        self.quantized_format, self.quant_kernel = plan.quantized_format, plan.quant_kernel

    def process_weights_after_loading(self) -> None:
        if self.quantized_format is None:
            return
        for name in ("gate_up_proj", "down_proj"):  # one stack at a time: peak memory one stack's blocks
            w = getattr(self, name)
            if isinstance(w, nn.Parameter):
                qw = QuantizedWeight.from_float(w.data, self.quantized_format, self.quant_kernel)
                delattr(self, name)  # drop the fp32 parameter before registering its replacement
                setattr(self, name, qw)


class FusedMoE(nn.Module):
    """Router + ``num_experts`` gated MLPs; each token goes to ``top_k`` of them."""

    def __init__(self, hidden_size: int, num_experts: int, intermediate_size: int, top_k: int,
                 renormalize: bool, hidden_act: str = "silu", impl: str = "grouped"):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and num_experts={num_experts}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size = intermediate_size
        # the router, named as in HF checkpoints; fp32 always: a flipped expert choice changes more than rounding
        self.gate = Linear(hidden_size, num_experts, role="dense")
        self.experts = ExpertWeights(num_experts, hidden_size, intermediate_size)
        self.act = get_activation(hidden_act)
        self.impl = impl
        # assignments per expert in the last forward ([E], on the model's device)
        self.tokens_per_expert: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        counts = torch.bincount(ids.reshape(-1), minlength=self.num_experts)
        self.tokens_per_expert = counts
        fn = EXPERT_IMPLS[self.impl]
        return fn(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids, self.act, counts)


def moe_layers(model: nn.Module) -> list[tuple[int, FusedMoE]]:
    """``(decoder layer index, FusedMoE)`` for every sparse layer of a Llama-family model (none for a
    model without a ``model.layers`` stack, e.g. Mamba2's ``backbone``)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        return []
    return [(i, layer.mlp) for i, layer in enumerate(layers) if isinstance(layer.mlp, FusedMoE)]


def set_moe_impl(model: nn.Module, impl: str) -> None:
    if impl not in EXPERT_IMPLS:
        raise ValueError(f"unknown MoE implementation {impl!r}; choose from {sorted(EXPERT_IMPLS)}")
    for _, moe in moe_layers(model):
        moe.impl = impl


# ----- loading ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExpertCheckpointLayout:
    """How one architecture names its MoE tensors in ``save_pretrained`` checkpoints."""

    block: str  # module name of the MoE block in checkpoints: "mlp" (Qwen3-MoE) or "block_sparse_moe" (Mixtral)
    gate: str  # per-expert gate projection name ("gate_proj" / "w1")
    up: str  # ("up_proj" / "w3")
    down: str  # ("down_proj" / "w2")


QWEN_EXPERT_LAYOUT = ExpertCheckpointLayout(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")


def load_expert_stack(param: torch.Tensor, source, block: str, which: str,
                      layout: ExpertCheckpointLayout = QWEN_EXPERT_LAYOUT) -> None:
    """Fill one stacked expert parameter (``gate_up_proj [E, 2I, H]`` or ``down_proj [E, H, I]``) from
    the per-expert tensors ``{block}.experts.{e}.{gate|up|down}.weight`` that ``save_pretrained`` writes."""
    from forwardpass.loader.weights import load_into

    inter = param.shape[1] // 2  # gate rows, then up rows
    for e in range(param.shape[0]):
        prefix = f"{block}.experts.{e}"
        if which == "gate_up_proj":
            load_into(param[e, :inter], source, f"{prefix}.{layout.gate}.weight")
            load_into(param[e, inter:], source, f"{prefix}.{layout.up}.weight")
        else:
            load_into(param[e], source, f"{prefix}.{layout.down}.weight")


def _first_present(source, names: list[str]) -> str | None:
    return next((n for n in names if n in source), None)


def load_moe_weights(model: nn.Module, source, layout: ExpertCheckpointLayout) -> None:
    """Load a Llama-family model whose sparse layers are ``FusedMoE``: dense tensors as usual, expert
    tensors from per-expert checkpoint names (or already-stacked ones) into the stacks."""
    from forwardpass.loader.weights import checkpoint_names, load_into

    sparse = dict(moe_layers(model))
    pattern = re.compile(r"model\.layers\.(\d+)\.mlp\.")
    for name, param in model.named_parameters():
        m = pattern.match(name)
        if m is None or int(m.group(1)) not in sparse:
            for ckpt_name, span in checkpoint_names(model, name):
                load_into(param if span is None else param[span[0] : span[1]], source, ckpt_name)
            continue
        layer, rest = m.group(0)[: -len(".mlp.")], name[m.end() :]
        blocks = [f"{layer}.{layout.block}", f"{layer}.mlp"] if layout.block != "mlp" else [f"{layer}.mlp"]
        if rest == "gate.weight":
            ckpt = _first_present(source, [f"{b}.gate.weight" for b in blocks]) or f"{blocks[0]}.gate.weight"
            load_into(param, source, ckpt)
            continue
        which = rest.split(".")[-1]  # gate_up_proj or down_proj
        stacked = _first_present(source, [f"{b}.experts.{which}" for b in blocks])
        if stacked is not None:  # transformers-5 in-memory layout written as is
            load_into(param, source, stacked)
            continue
        block = next((b for b in blocks if f"{b}.experts.0.{layout.down}.weight" in source), blocks[0])
        num_experts = param.shape[0]
        load_expert_stack(param, source, block, which, layout)
        extra = f"{block}.experts.{num_experts}.{layout.down}.weight"
        if extra in source:
            raise WeightShapeError(
                f"the checkpoint in {source.model_dir} has more experts than config.json's {num_experts} "
                f"(found {extra!r}); does config.json match the weights?"
            )


class MoECausalLMMixin:
    """Shared by the MoE architectures: self-loading stacked experts, routing counts, impl switch."""

    expert_layout: ExpertCheckpointLayout

    def load_weights(self, source) -> None:
        load_moe_weights(self, source, self.expert_layout)

    def moe_layers(self) -> list[tuple[int, FusedMoE]]:
        return moe_layers(self)

    def routing_counts(self) -> list[list[int]]:
        """Tokens each expert received in the last forward, one list per MoE layer."""
        return [list(c) for c in ModelRoutingCounter(self).collect()]

    def set_moe_impl(self, impl: str) -> None:
        set_moe_impl(self, impl)


# ----- routing statistics -------------------------------------------------------------------------
@dataclass
class RoutingRecord:
    """Expert loads of one engine step (``step`` matches the step's ``StepRecord.step``)."""

    step: int
    num_tokens: int  # rows in the step's forward pass (prefill + decode)
    layers: list[int]  # decoder layer index of each MoE layer
    tokens_per_expert: list[list[int]]  # [MoE layer][expert]: token assignments (each token counts top_k times)

    def to_dict(self) -> dict:
        return asdict(self)


class ModelRoutingCounter:
    """Reads every MoE layer's counts of the last forward in one host copy (the runner's ``RoutingCounter``)."""

    def __init__(self, model: nn.Module):
        self.layers = [moe for _, moe in moe_layers(model)]

    def collect(self) -> tuple[tuple[int, ...], ...]:
        counts = [m.tokens_per_expert if m.tokens_per_expert is not None
                  else torch.zeros(m.num_experts, dtype=torch.long, device=m.gate.weight.device) for m in self.layers]
        return tuple(tuple(row) for row in torch.stack(counts).tolist())


class RoutingStats(deque):
    """Per-step :class:`RoutingRecord`s of an engine (bounded like ``engine.stats``), filled by the engine core."""

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
