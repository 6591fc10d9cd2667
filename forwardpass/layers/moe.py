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
``w1/w3/w2``); ``models/moe_loading.py`` copies them into the stacks (a checkpoint already holding the
stacked tensors is read directly).

Routing is observable: each ``FusedMoE`` keeps ``tokens_per_expert`` of its last forward as a tensor;
the engine reads and records them (``engine/worker/routing_stats.py``). The grouped CPU path itself needs the
counts on the host to slice its sorted tokens per expert; a fused GPU kernel would not.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from forwardpass.layers.activation import get_activation, silu_and_mul
from forwardpass.layers.linear import Linear
from forwardpass.layers.weight_interface import matmul
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
        h = silu_and_mul(matmul(xs[start : start + n], gate_up[e]), act)
        outs.append(matmul(h, down[e]))
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
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size),
                                      requires_grad=False)
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
        # the router, named as in HF checkpoints; fp32 always: a flipped expert choice
        # changes more than rounding
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
