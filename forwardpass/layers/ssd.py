"""Mamba2's state-space mixer in PyTorch: the causal depthwise conv with its rolling window, the
chunked SSD scan (prefill) and the one-token recurrent update (decode), and the gated RMSNorm.

Per head ``h`` the SSM keeps a state ``S_h [head_dim, N]``; for each token, with
``dt = softplus(dt_raw + dt_bias)`` and ``A_h = -exp(A_log_h)``::

    S_h ← exp(dt·A_h) · S_h + dt · x_h ⊗ B        y_h = S_h · C + D_h · x_h

(``B``, ``C`` of ``N`` values are shared by the heads of a group.) Decode applies this once per token
(``ssm_step``). Prefill uses the chunked "state space duality" form (``ssd_scan``, Mamba2 §6, the
same computation as HF transformers' ``torch_forward``): inside each chunk of ``chunk`` tokens the
outputs are an attention-like masked matmul (``C·Bᵀ`` weighted by segment sums of ``dt·A``), and the
states are passed from chunk to chunk, starting from the sequence's carried state. Both return the
final state, which is all that is kept: ``conv_kernel - 1`` conv inputs plus ``heads·head_dim·N`` SSM
values per request and layer, whatever the length.

A fast kernel would fuse the conv, the scan and the state write per sequence (the ``mamba_ssm``
Triton kernels: ``mamba_chunk_scan_combined`` with ``initial_states`` and varlen ``cu_seqlens``,
``selective_state_update`` reading the slot in place); here a prefill chunk is one PyTorch scan per
sequence and decode rows are batched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = sum(x[..., j+1 : i+1])`` for ``j <= i``, ``-inf`` above the diagonal."""
    n = x.size(-1)
    x = x[..., None].expand(*x.size(), n)
    x = x.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=-1), 0)
    out = torch.cumsum(x, dim=-2)
    return out.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=0),
                           -torch.inf)


def ssd_scan(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor,
    chunk: int, initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: x ``[L, H, P]``, dt ``[L, H]`` (softplus'd), a ``[H]``, b/c ``[L, G, N]``, d ``[H]``,
    initial_state ``[H, P, N]`` or None → (y ``[L, H, P]`` float32, final state ``[H, P, N]`` float32)."""
    length, heads, _ = x.shape
    x, dt = x.float()[None], dt.float()[None]
    b = b.float().repeat_interleave(heads // b.shape[1], dim=1)[None]
    c = c.float().repeat_interleave(heads // c.shape[1], dim=1)[None]
    pad = (chunk - length % chunk) % chunk
    d_residual = d.float()[:, None] * F.pad(x, (0, 0, 0, 0, 0, pad))
    x = x * dt[..., None]
    a = a.float() * dt

    def chunks(t: torch.Tensor) -> torch.Tensor:
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(1, -1, chunk, *t.shape[2:])

    x, a, b, c = chunks(x), chunks(a), chunks(b), chunks(c)
    a = a.permute(0, 3, 1, 2)  # [1, H, chunks, chunk]
    a_cumsum = torch.cumsum(a, dim=-1)
    # 1. within each chunk: masked "attention" C·Bᵀ with decays
    decay = torch.exp(segment_sum(a))
    scores = torch.einsum("bclhn,bcshn->bclsh", c, b) * decay.permute(0, 2, 3, 4, 1)
    y_diag = torch.einsum("bclsh,bcshp->bclhp", scores, x)
    # 2. each chunk's own contribution to the state at its end
    decay_states = torch.exp(a_cumsum[:, :, :, -1:] - a_cumsum)
    states = torch.einsum("bclhn,bclhp->bchpn", b * decay_states.permute(0, 2, 3, 1)[..., None], x)
    # 3. pass states from chunk to chunk, starting from the carried state
    prev = initial_state.float()[None, None] if initial_state is not None else torch.zeros_like(states[:, :1])
    states = torch.cat([prev, states], dim=1)
    decay_chunk = torch.exp(segment_sum(F.pad(a_cumsum[:, :, :, -1], (1, 0)))).transpose(1, 3)
    new_states = torch.einsum("bzch,bzhpn->bchpn", decay_chunk, states)
    states, final = new_states[:, :-1], new_states[:, -1]
    # 4. what each chunk's start state contributes to its outputs
    y_off = torch.einsum("bclhn,bchpn->bclhp", c, states) * torch.exp(a_cumsum).permute(0, 2, 3, 1)[..., None]
    y = (y_diag + y_off).reshape(1, -1, heads, x.shape[-1]) + d_residual
    return y[0, :length], final[0]


def ssm_step(
    state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
    d: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: state ``[B, H, P, N]``, x ``[B, H, P]``, dt ``[B, H]`` (softplus'd), a/d
    ``[H]``, b/c ``[B, G, N]`` → (y ``[B, H, P]``, new state), in float32."""
    heads = x.shape[1]
    x, dt = x.float(), dt.float()[..., None, None]
    b = b.float().repeat_interleave(heads // b.shape[1], dim=1)[:, :, None]  # [B, H, 1, N]
    c = c.float().repeat_interleave(heads // c.shape[1], dim=1)
    state = state.float() * torch.exp(dt * a.float()[:, None, None]) + (dt * b) * x[..., None]
    y = torch.einsum("bhpn,bhn->bhp", state, c) + x * d.float()[:, None]
    return y, state


def causal_conv(
    x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of one sequence's new inputs x ``[L, C]`` after its last ``K - 1`` inputs
    ``window [C, K - 1]`` (zeros at the start), weight ``[C, K]`` → (silu(conv) ``[L, C]``, new window)."""
    full = torch.cat([window.to(x.dtype), x.t()], dim=-1)  # [C, K - 1 + L]
    out = F.conv1d(full[None], weight[:, None], bias, groups=weight.shape[0])[0]  # [C, L]
    return F.silu(out.t()), full[:, full.shape[1] - window.shape[1]:]


def causal_conv_step(
    x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: x ``[B, C]``, window ``[B, C, K - 1]`` → (silu(conv)
    ``[B, C]``, new window)."""
    full = torch.cat([window.to(x.dtype), x[..., None]], dim=-1)  # [B, C, K]
    out = (full * weight).sum(-1)
    if bias is not None:
        out = out + bias
    return F.silu(out), full[..., 1:]


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, groups: int,
                   eps: float) -> torch.Tensor:
    """Mamba2's output norm: ``x · silu(gate)``, RMS-normalized in ``groups`` groups, times ``weight``."""
    dtype = gate.dtype
    h = x.float() * F.silu(gate.float())
    h = h.view(*h.shape[:-1], groups, -1)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.view(*x.shape[:-1], -1).to(dtype)
