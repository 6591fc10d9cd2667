"""The gated delta rule (Gated DeltaNet, Qwen3-Next's linear attention) in PyTorch: chunked for
prefill, one token at a time for decode.

Per value head the state is a matrix ``S [k_dim, v_dim]``; for each token, with decay
``g = -exp(A_log) · softplus(a + dt_bias)`` (log space, <= 0) and write strength ``β = sigmoid(b)``,
and L2-normalized ``q`` (scaled by ``k_dim ** -0.5``) and ``k``::

    S ← exp(g) · S                 (forget)
    S ← S + k ⊗ β (v − Sᵀk)         (delta rule: write only what S does not already predict for k)
    o = Sᵀ q

``gated_delta_step`` is that update for one token per sequence. ``gated_delta_chunked`` is the same
computation a chunk of ``chunk`` tokens at a time (the WY / UT-transform form of the DeltaNet paper, as
HF's ``torch_chunk_gated_delta_rule``): inside a chunk the updates are condensed with a triangular
solve, and the state is passed from chunk to chunk starting from the sequence's carried state. The
state is all a request keeps, whatever its length.

A fast kernel (FLA's ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``) fuses the
chunk loop and reads states in place by slot with varlen ``cu_seqlens``; here each prefill chunk of
each sequence is its own PyTorch call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q: torch.Tensor, k: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    rep = heads // q.shape[-2]
    q, k = q.float().repeat_interleave(rep, dim=-2), k.float().repeat_interleave(rep, dim=-2)
    q = l2norm(q)
    return q * q.shape[-1] ** -0.5, l2norm(k)


def gated_delta_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, chunk: int,
    initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q/k ``[L, Hk, Dk]``, v ``[L, Hv, Dv]``, g/beta ``[L, Hv]``, state ``[Hv, Dk, Dv]`` or
    None → (o ``[L, Hv, Dv]`` float32, final state float32)."""
    length, heads, dv = v.shape
    q, k = _prepare(q, k, heads)
    # [H, L, ...]
    q, k, v = (x.transpose(0, 1) for x in (q, k, v.float()))
    beta, g = beta.float().t(), g.float().t()
    pad = (chunk - length % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(heads, -1, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(heads, -1, chunk).cumsum(dim=-1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, k_beta * g.exp()[..., None], upper=False,
                                          unitriangular=True)
    state = (initial_state.float() if initial_state is not None
             else torch.zeros(heads, k.shape[-1], dv, dtype=torch.float32, device=q.device))
    q = q * g.exp()[..., None]
    k = k * (g[..., -1:] - g).exp()[..., None]
    chunk_decay = g[..., -1].exp()[..., None, None]
    out = torch.empty_like(new_v)
    for i in range(new_v.shape[1]):
        v_i = new_v[:, i] - k_cum[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_i
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_i
    return out.reshape(heads, -1, dv)[:, :length].transpose(0, 1), state


def gated_delta_step(
    state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: state ``[B, Hv, Dk, Dv]``, q/k ``[B, Hk, Dk]``, v ``[B, Hv, Dv]``, g/beta
    ``[B, Hv]`` → (o ``[B, Hv, Dv]``, new state), in float32."""
    q, k = _prepare(q, k, v.shape[1])
    state = state.float() * g.float().exp()[..., None, None]
    predicted = (state * k[..., None]).sum(dim=-2)
    delta = (v.float() - predicted) * beta.float()[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state
