"""DiT denoiser over latent patches (Peebles & Xie 2023), with cross-attention to text tokens.

Shapes: latents ``[B, C, H, W]`` → ``p×p`` patches → ``N = HW/p²`` tokens of width ``hidden_size``.
Each block is

    x += gate₁ · SelfAttn(modulate(LN(x), shift₁, scale₁))      # adaLN-Zero
    x += CrossAttn(LN(x), text_tokens)                           # as in PixArt-α
    x += gate₂ · MLP(modulate(LN(x), shift₂, scale₂))

where (shift, scale, gate) come from a per-block linear map of the conditioning vector
``c = TimestepEmbed(t) + Linear(text[CLS])``. The map is zero-initialised, so every block starts as the
identity — the "Zero" in adaLN-Zero, which is what makes deep DiTs train stably from scratch.

The output is the flow-matching velocity ``v = noise − x₀`` (``prediction_type = "flow"``) at
``timestep = σ · 1000``; the pipeline converts it for schedulers that want ε or x₀.
Position embeddings are fixed 2-D sin-cos computed for the actual grid, so other sizes run too.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from forwardpass.attention import attention
from forwardpass.diffusion.modeling import ConfigModule


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding of (possibly fractional) timesteps ``t: [B]`` → ``[B, dim]``."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def sincos_2d(h: int, w: int, dim: int, device: torch.device) -> torch.Tensor:
    """Fixed 2-D sin-cos position embedding ``[h*w, dim]`` (half the channels for rows, half for columns)."""
    quarter = dim // 4
    omega = 1.0 / (10000 ** (torch.arange(quarter, dtype=torch.float32, device=device) / quarter))
    ys, xs = torch.meshgrid(
        torch.arange(h, dtype=torch.float32, device=device),
        torch.arange(w, dtype=torch.float32, device=device),
        indexing="ij",
    )
    out = []
    for grid in (ys.flatten(), xs.flatten()):
        a = grid[:, None] * omega[None]
        out += [torch.sin(a), torch.cos(a)]
    return torch.cat(out, dim=1)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


class Attention(nn.Module):
    """Multi-head attention; ``context=None`` is self-attention, otherwise cross-attention to ``context``."""

    def __init__(self, dim: int, heads: int, context_dim: int | None, backend: str):
        super().__init__()
        self.heads, self.backend = heads, backend
        self.to_q = nn.Linear(dim, dim)
        self.to_kv = nn.Linear(context_dim or dim, 2 * dim)
        self.to_out = nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, context: torch.Tensor | None = None, context_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        b, n, d = x.shape
        ctx = x if context is None else context
        hd = d // self.heads
        q = self.to_q(x).view(b, n, self.heads, hd).transpose(1, 2)
        k, v = self.to_kv(ctx).view(b, ctx.shape[1], 2, self.heads, hd).permute(2, 0, 3, 1, 4)
        out = attention(q, k, v, causal=False, key_padding_mask=context_mask, backend=self.backend)
        return self.to_out(out.transpose(1, 2).reshape(b, n, d))


class DiTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, context_dim: int, mlp_ratio: float, backend: str):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(dim, heads, None, backend)
        self.norm_cross = nn.LayerNorm(dim, eps=1e-6)
        self.cross = Attention(dim, heads, context_dim, backend)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, dim))
        self.ada = nn.Linear(dim, 6 * dim)
        nn.init.zeros_(self.ada.weight)
        nn.init.zeros_(self.ada.bias)

    def forward(self, x, c, context, context_mask):
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(F.silu(c)).chunk(6, dim=-1)
        x = x + gate1[:, None] * self.attn(modulate(self.norm1(x), shift1, scale1))
        x = x + self.cross(self.norm_cross(x), context, context_mask)
        return x + gate2[:, None] * self.mlp(modulate(self.norm2(x), shift2, scale2))


class DiTTransformer2DModel(ConfigModule):
    DEFAULTS: ClassVar[dict[str, Any]] = {
        "in_channels": 4,
        "out_channels": 4,
        "sample_size": 8,
        "patch_size": 2,
        "hidden_size": 128,
        "num_layers": 4,
        "num_attention_heads": 4,
        "mlp_ratio": 3.0,
        "cross_attention_dim": 64,
        "prediction_type": "flow",
        "attention_backend": "sdpa",
    }

    def __init__(self, **config):
        super().__init__(**config)
        c = self.config
        d, p = c["hidden_size"], c["patch_size"]
        self.patch_embed = nn.Linear(c["in_channels"] * p * p, d)
        self.t_embed = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d))
        self.text_pool = nn.Linear(c["cross_attention_dim"], d)
        self.blocks = nn.ModuleList(
            DiTBlock(
                d, c["num_attention_heads"], c["cross_attention_dim"], c["mlp_ratio"], c["attention_backend"]
            )
            for _ in range(c["num_layers"])
        )
        self.norm_out = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.ada_out = nn.Linear(d, 2 * d)
        self.proj_out = nn.Linear(d, c["out_channels"] * p * p)
        for layer in (self.ada_out, self.proj_out):  # zero output layer: the untrained model predicts 0
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        b, ch, h, w = x.shape
        p = self.config["patch_size"]
        x = x.reshape(b, ch, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(b, (h // p) * (w // p), ch * p * p)

    def unpatchify(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        b = x.shape[0]
        p, ch = self.config["patch_size"], self.config["out_channels"]
        x = x.reshape(b, h // p, w // p, ch, p, p).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(b, ch, h, w)

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``hidden_states [B, C, H, W]``, ``timestep [B]`` (σ·1000), text ``[B, L, Dtxt]`` → velocity."""
        b, _, h, w = hidden_states.shape
        p, d = self.config["patch_size"], self.config["hidden_size"]
        x = self.patch_embed(self.patchify(hidden_states))
        x = x + sincos_2d(h // p, w // p, d, x.device)[None]
        if timestep.ndim == 0:
            timestep = timestep.expand(b)
        c = self.t_embed(timestep_embedding(timestep, d)) + self.text_pool(encoder_hidden_states[:, 0])
        for block in self.blocks:
            x = block(x, c, encoder_hidden_states, encoder_attention_mask)
        shift, scale = self.ada_out(F.silu(c)).chunk(2, dim=-1)
        x = self.proj_out(modulate(self.norm_out(x), shift, scale))
        return self.unpatchify(x, h, w)
