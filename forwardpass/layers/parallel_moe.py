"""The MoE block across ranks: expert parallel (whole experts per rank) or tensor parallel (every
expert split like a dense MLP).

**Expert parallel** (``enable_expert_parallel=True``): rank ``r`` holds experts
``[r·E/N, (r+1)·E/N)`` whole. The router is replicated, so every rank routes every token the same
way; each rank runs only the (token, expert) assignments of its own experts and the weighted partial
outputs are summed with one all-reduce of ``[T, hidden]``.

**Tensor parallel** (the default with ``tensor_parallel_size > 1``): every rank holds every expert's
slice ``[r·I/N, (r+1)·I/N)`` of the intermediate channels (gate/up rows, down columns), runs all
assignments on its slice, and the partial outputs are summed with the same all-reduce.

Dispatch: all-reduce of the partial outputs, not all-to-all. Here the hidden states are already
replicated on every rank (attention is tensor parallel and ends in an all-reduce), so no token has
to travel to its expert: every rank already has them all. An all-to-all pays off when each rank holds
*different* tokens (attention data parallel), where it moves ``T·k·hidden`` per rank instead of
``T·hidden``; with replicated tokens the all-reduce moves ``2·(N-1)/N·T·hidden`` and is one collective
that gloo on CPU runs as well as NCCL on GPU.

Routing statistics: the router is replicated, so rank 0 counts every expert's assignments as with one
rank (``ModelRoutingCounter``); ``engine/worker/routing_stats.py``'s :func:`rank_loads` sums them per rank's
expert range.
"""

from __future__ import annotations

import torch
from torch import nn

from forwardpass.layers.activation import get_activation, silu_and_mul
from forwardpass.layers.linear import Linear
from forwardpass.layers.moe import ExpertWeights, FusedMoE, route
from forwardpass.layers.parallel_linear import Shard, even_split
from forwardpass.layers.weight_interface import matmul
from forwardpass.parallel_state import TensorParallel


def local_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act,
    first: int,
) -> torch.Tensor:
    """``Σ`` over the assignments to experts ``[first, first + len(gate_up))`` of ``w · expert(x)``: this
    rank's share of the MoE output (zeros for tokens none of its experts received)."""
    k, count = ids.shape[1], gate_up.shape[0]
    flat = ids.reshape(-1) - first
    mine = ((flat >= 0) & (flat < count)).nonzero().squeeze(1)  # assignment positions of local experts
    out = torch.zeros_like(x)
    if mine.numel() == 0:
        return out
    experts = flat[mine]
    order = torch.argsort(experts, stable=True)
    mine = mine[order]
    sizes = torch.bincount(experts, minlength=count).tolist()
    token_of = mine // k
    xs = x.index_select(0, token_of)
    outs, start = [], 0
    for e, n in enumerate(sizes):
        if n:
            outs.append(matmul(silu_and_mul(matmul(xs[start : start + n], gate_up[e]), act), down[e]))
            start += n
    y = torch.cat(outs) if len(outs) > 1 else outs[0]
    out.index_add_(0, token_of, y * weights.reshape(-1)[mine].to(y.dtype).unsqueeze(1))
    return out


class ParallelFusedMoE(FusedMoE):
    """``FusedMoE`` whose expert stacks hold this rank's experts (EP) or slices (TP); same router."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        intermediate_size: int,
        top_k: int,
        renormalize: bool,
        hidden_act: str,
        tp: TensorParallel,
    ):
        nn.Module.__init__(self)  # FusedMoE's own init would allocate all experts at full width
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and num_experts={num_experts}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size, self.tp = intermediate_size, tp
        self.gate = Linear(hidden_size, num_experts)  # the router: replicated
        if tp.expert_parallel:
            self.first_expert, end = even_split(num_experts, tp, "the experts")
            self.channels = (0, intermediate_size)
            self.experts = ExpertWeights(end - self.first_expert, hidden_size, intermediate_size)
        else:
            self.first_expert = 0
            self.channels = even_split(intermediate_size, tp, "the expert MLP width")
            self.experts = ExpertWeights(num_experts, hidden_size, self.channels[1] - self.channels[0])
        self.act = get_activation(hidden_act)
        self.impl = "grouped"
        self.tokens_per_expert: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        self.tokens_per_expert = torch.bincount(ids.reshape(-1), minlength=self.num_experts)
        part = local_experts(
            x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids, self.act, self.first_expert
        )
        return self.tp.all_reduce(part)

    def expert_shards(self, which: str) -> tuple[range, list[Shard]]:
        """Global expert ids on this rank, and for each the slices of its checkpoint tensors:
        ``gate_up_proj`` rows ``[0, I_local)`` from gate and ``[I_local, 2·I_local)`` from up (dim 0),
        ``down_proj`` columns (dim 1)."""
        c0, c1 = self.channels
        n = c1 - c0
        experts = range(self.first_expert, self.first_expert + self.experts.gate_up_proj.shape[0])
        if which == "gate_up_proj":
            return experts, [Shard("gate", (0, n), 0, (c0, c1)), Shard("up", (n, 2 * n), 0, (c0, c1))]
        return experts, [Shard("down", (0, self.experts.down_proj.shape[1]), 1, (c0, c1))]
