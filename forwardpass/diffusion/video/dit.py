"""Video DiT: the image DiT's blocks over a clip's latents, patchified in space *and* time.

Shapes: latents ``[B, F, C, H, W]`` (the image VAE applied per frame) → ``pt×p×p`` patches →
``T·S`` tokens with ``T = F/pt`` temporal and ``S = HW/p²`` spatial positions, token order ``(t, y, x)``.

Two attention layouts (``attention_mode``), both through the shared ``forwardpass.attention`` interface:

* ``"full"``: one self-attention over all ``T·S`` tokens of the clip. Every token sees every frame, which is
  what lets a whole-clip model keep one digit and one trajectory consistent; its cost grows as ``(T·S)²``.
* ``"factorized"``: self-attention within each frame (``S`` tokens, batch ``B·T``), then a temporal
  attention across frames at each spatial position (``T`` tokens, batch ``B·S``): ``T·S² + S·T²`` instead of
  ``(T·S)²`` (Latte / "divided space-time attention" of TimeSformer).

Timesteps may differ per frame (``timestep [B, F]``): the adaLN conditioning is computed per temporal
position and broadcast over that frame's tokens. That is what lets the *same* network run autoregressively,
frame by frame (clean earlier frames, the current frame noisy, later frames pure noise; "diffusion forcing",
Chen et al. 2024), which the pipeline uses as the frame-by-frame baseline.

``from_image_dit`` inflates a trained image DiT into this shape (same block weights; temporal position and
temporal attention zero-initialised), so a video model starts as the image model applied per frame.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from forwardpass.diffusion.dit import (
    Attention,
    DiTBlock,
    DiTTransformer2DModel,
    sincos_2d,
    timestep_embedding,
)
from forwardpass.diffusion.modeling import ConfigModule
from forwardpass.errors import ConfigError, ValidationError

ATTENTION_MODES = ("full", "factorized")


def _per_frame(h: torch.Tensor, m: torch.Tensor, t: int) -> torch.Tensor:
    """Broadcast per-temporal-position ``m [B, T, d]`` over the ``S`` tokens of each position of ``h``."""
    b, n, d = h.shape
    return m[:, :, None].expand(b, t, n // t, d).reshape(b, n, d)


class VideoDiTBlock(DiTBlock):
    """The image DiT block (same layers, same weight names: an image DiT inflates into it) with per-frame
    adaLN and, in ``factorized`` mode, a temporal attention layer."""

    def __init__(self, dim: int, heads: int, context_dim: int, mlp_ratio: float, backend: str, mode: str):
        super().__init__(dim, heads, context_dim, mlp_ratio, backend)
        self.mode = mode
        if mode == "factorized":
            self.norm_temporal = nn.LayerNorm(dim, eps=1e-6)
            self.attn_temporal = Attention(dim, heads, None, backend)
            # Zero output: a fresh temporal layer is the identity, so an inflated image DiT starts unchanged.
            nn.init.zeros_(self.attn_temporal.to_out.weight)
            nn.init.zeros_(self.attn_temporal.to_out.bias)

    def forward(self, x: torch.Tensor, c: torch.Tensor, context: torch.Tensor, mask: torch.Tensor | None,
                t: int) -> torch.Tensor:  # fmt: skip
        b, n, d = x.shape
        s = n // t
        shift1, scale1, gate1, shift2, scale2, gate2 = (
            _per_frame(x, m, t) for m in self.ada(F.silu(c)).chunk(6, dim=-1)
        )
        h = self.norm1(x) * (1 + scale1) + shift1
        if self.mode == "full":
            a = self.attn(h)
        else:  # space: each frame alone; then time: each spatial position across frames
            a = self.attn(h.reshape(b * t, s, d)).reshape(b, n, d)
        x = x + gate1 * a
        if self.mode == "factorized":
            h = self.norm_temporal(x).reshape(b, t, s, d).transpose(1, 2).reshape(b * s, t, d)
            a = self.attn_temporal(h).reshape(b, s, t, d).transpose(1, 2).reshape(b, n, d)
            x = x + a
        x = x + self.cross(self.norm_cross(x), context, mask)
        return x + gate2 * self.mlp(self.norm2(x) * (1 + scale2) + shift2)


class VideoDiTModel(ConfigModule):
    DEFAULTS: ClassVar[dict[str, Any]] = {
        "in_channels": 4,
        "out_channels": 4,
        "sample_size": 8,
        "num_frames": 8,
        "patch_size": 2,
        "patch_size_t": 1,
        "hidden_size": 128,
        "num_layers": 4,
        "num_attention_heads": 4,
        "mlp_ratio": 3.0,
        "cross_attention_dim": 64,
        "attention_mode": "full",
        "prediction_type": "flow",
        "attention_backend": "sdpa",
        # > 0: a learned embedding of the prompt's motion direction (0 = none, 1.. = moving_digits.DIRECTIONS)
        # in the per-frame adaLN conditioning (``forward``). Issue 43: through the frozen text encoder a
        # direction word reached the DiT at ~0.1x a digit word's scale and training never learned to read it.
        "num_directions": 0,
    }

    def __init__(self, **config):
        super().__init__(**config)
        c = self.config
        if c["attention_mode"] not in ATTENTION_MODES:
            raise ConfigError(f"attention_mode must be one of {ATTENTION_MODES}, got {c['attention_mode']!r}")
        d, p, pt = c["hidden_size"], c["patch_size"], c["patch_size_t"]
        self.patch_embed = nn.Linear(c["in_channels"] * pt * p * p, d)
        self.t_embed = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d))
        self.text_pool = nn.Linear(c["cross_attention_dim"], d)
        self.frame_embed = nn.Linear(
            d, d
        )  # temporal position; zero-init so inflation starts as the image DiT
        nn.init.zeros_(self.frame_embed.weight)
        nn.init.zeros_(self.frame_embed.bias)
        self.blocks = nn.ModuleList(
            VideoDiTBlock(d, c["num_attention_heads"], c["cross_attention_dim"], c["mlp_ratio"],
                          c["attention_backend"], c["attention_mode"])
            for _ in range(c["num_layers"])
        )  # fmt: skip
        if c["num_directions"]:
            # [global | motion] halves; zero-init: a model fine-tuned from one without it starts as that model
            self.direction_embed = nn.Embedding(c["num_directions"] + 1, 2 * d)
            nn.init.zeros_(self.direction_embed.weight)
        self.norm_out = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.ada_out = nn.Linear(d, 2 * d)
        self.proj_out = nn.Linear(d, c["out_channels"] * pt * p * p)
        for layer in (self.ada_out, self.proj_out):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    # ------------------------------------------------------------------ patches
    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, F, C, H, W]`` → ``[B, T·S, C·pt·p·p]``, tokens ordered (t, y, x), features (C, pt, p, p)."""
        b, f, ch, h, w = x.shape
        p, pt = self.config["patch_size"], self.config["patch_size_t"]
        x = x.reshape(b, f // pt, pt, ch, h // p, p, w // p, p).permute(0, 1, 4, 6, 3, 2, 5, 7)
        return x.reshape(b, (f // pt) * (h // p) * (w // p), ch * pt * p * p)

    def unpatchify(self, x: torch.Tensor, f: int, h: int, w: int) -> torch.Tensor:
        b = x.shape[0]
        p, pt, ch = self.config["patch_size"], self.config["patch_size_t"], self.config["out_channels"]
        x = x.reshape(b, f // pt, h // p, w // p, ch, pt, p, p).permute(0, 1, 5, 4, 2, 6, 3, 7)
        return x.reshape(b, f, ch, h, w)

    def _frame_timesteps(self, timestep: torch.Tensor, b: int, f: int) -> torch.Tensor:
        """Any of ``[]``, ``[B]``, ``[B, F]`` → ``[B, T]`` (one timestep per temporal patch)."""
        pt = self.config["patch_size_t"]
        if timestep.ndim == 0:
            timestep = timestep.expand(b)
        if timestep.ndim == 1:
            return timestep[:, None].expand(b, f // pt)
        if tuple(timestep.shape) != (b, f):
            raise ValidationError(f"timestep must be [B] or [B, F] = [{b}, {f}], got {tuple(timestep.shape)}")
        grouped = timestep.reshape(b, f // pt, pt)
        if pt > 1 and not torch.equal(grouped, grouped[..., :1].expand_as(grouped)):
            raise ValidationError(
                f"per-frame timesteps must agree within each group of patch_size_t={pt} frames"
            )
        return grouped[..., 0]

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor | None = None,
        direction: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``hidden_states [B, F, C, H, W]``, ``timestep`` (σ·1000) ``[B]`` or per frame ``[B, F]``, text
        ``[B, L, Dtxt]``, ``direction [B]`` (the prompt's direction index, ``moving_digits.direction_index``;
        ignored by a model without ``num_directions``) → flow velocity ``[B, F, C, H, W]``."""
        b, f, _, h, w = hidden_states.shape
        p, pt, d = self.config["patch_size"], self.config["patch_size_t"], self.config["hidden_size"]
        if f % pt or h % p or w % p:
            raise ValidationError(f"latent clip {f}×{h}×{w} is not divisible by the patch {pt}×{p}×{p}")
        t = f // pt
        ts = self._frame_timesteps(timestep.to(hidden_states.device), b, f)
        x = self.patch_embed(self.patchify(hidden_states))
        pos_t = self.frame_embed(timestep_embedding(torch.arange(t, device=x.device), d))  # [T, d]
        pos = sincos_2d(h // p, w // p, d, x.device)[None] + pos_t[:, None]  # [T, S, d]
        x = x + pos.reshape(1, -1, d)
        c = self.t_embed(timestep_embedding(ts.reshape(-1), d)).view(b, t, d)
        c = c + self.text_pool(encoder_hidden_states[:, 0])[:, None]
        if direction is not None and self.config["num_directions"]:
            c = c + self._direction_conditioning(direction.to(c.device), t)
        for block in self.blocks:
            x = block(x, c, encoder_hidden_states, encoder_attention_mask, t)
        shift, scale = (_per_frame(x, m, t) for m in self.ada_out(F.silu(c)).chunk(2, dim=-1))
        x = self.proj_out(self.norm_out(x) * (1 + scale) + shift)
        return self.unpatchify(x, f, h, w)

    def _direction_conditioning(self, direction: torch.Tensor, t: int) -> torch.Tensor:
        """``[B, T, d]``: the direction's global vector plus its motion vector times the frame's signed
        distance from the clip's middle (in units of 4 frames, so it means the same at any length). Why the
        second term: with one vector for the whole clip the model's σ = 1 estimate for "left" and "right"
        stayed the same (0.008 rms apart after 400 fine-tuning steps, the training means 0.70): a global
        vector must interact with the temporal position through a nonlinearity to place the ink frame by
        frame, a signed per-frame one shifts each frame's adaLN (and so its attention) directly."""
        glob, motion = self.direction_embed(direction).chunk(2, dim=-1)  # [B, d] each
        tau = (torch.arange(t, device=direction.device, dtype=glob.dtype) - (t - 1) / 2) / 4
        return glob[:, None] + tau[None, :, None] * motion[:, None]

    def with_directions(self, num_directions: int) -> VideoDiTModel:
        """This model plus a zero direction embedding: the same outputs until fine-tuning trains it."""
        if self.config["num_directions"]:
            return self
        model = type(self)(**{**self.config, "num_directions": num_directions})
        missing, unexpected = model.load_state_dict(self.state_dict(), strict=False)
        assert missing == ["direction_embed.weight"] and not unexpected, (missing, unexpected)
        return model

    def with_attention_mode(self, mode: str) -> tuple[VideoDiTModel, dict[str, list[str]]]:
        """This model's weights in another ``attention_mode``, and the mapping to log (``kept`` / ``dropped``
        / ``new`` weight names). Both modes name the per-frame-or-whole-clip self-attention ``attn``, so
        factorized → full keeps it (the spatial attention becomes the full attention over all ``T·S``
        tokens) and drops ``attn_temporal`` / ``norm_temporal``; full → factorized adds them as the identity
        (zero output). The frame position (``frame_embed``, added to every token) and the per-frame adaLN
        carry over, so the full attention knows each token's frame. Not the same function after
        factorized → full (the spatial softmax now spans the clip): it is a start for fine-tuning."""
        if mode not in ATTENTION_MODES:
            raise ConfigError(f"attention_mode must be one of {ATTENTION_MODES}, got {mode!r}")
        model = type(self)(**{**self.config, "attention_mode": mode})
        old, new = self.state_dict(), model.state_dict()
        kept = [k for k in new if k in old]
        for k in kept:
            if old[k].shape != new[k].shape:
                raise ValidationError(f"{k}: shape {tuple(old[k].shape)} vs {tuple(new[k].shape)}")
            new[k] = old[k]
        model.load_state_dict(new)
        mapping = {"kept": kept, "dropped": [k for k in old if k not in new],
                   "new": [k for k in new if k not in old]}  # fmt: skip
        return model.train(self.training), mapping

    # ------------------------------------------------------------------ inflation
    @classmethod
    def from_image_dit(cls, image: DiTTransformer2DModel, **overrides: Any) -> VideoDiTModel:
        """A video DiT whose every shared weight comes from ``image``; with ``patch_size_t = pt > 1`` the
        patch embedding averages the ``pt`` frames of a patch and the output repeats the
        image prediction for each."""
        shared = ("in_channels", "out_channels", "sample_size", "patch_size", "hidden_size", "num_layers",
                  "num_attention_heads", "mlp_ratio", "cross_attention_dim", "prediction_type",
                  "attention_backend")  # fmt: skip
        video = cls(**{**{k: image.config[k] for k in shared}, **overrides})
        pt, p, ch = video.config["patch_size_t"], video.config["patch_size"], video.config["in_channels"]
        state = video.state_dict()
        for name, tensor in image.state_dict().items():
            if name == "patch_embed.weight":  # [d, C·p·p] → [d, C, pt, p, p] / pt
                w = tensor.view(-1, ch, 1, p, p).expand(-1, ch, pt, p, p) / pt
                state[name] = w.reshape(tensor.shape[0], -1)
            elif name.startswith("proj_out."):  # [C·p·p, ...] → [C, pt, p, p, ...]
                rest = tensor.shape[1:]
                w = tensor.view(ch, 1, p, p, *rest).expand(ch, pt, p, p, *rest)
                state[name] = w.reshape(-1, *rest)
            else:
                state[name] = tensor
        video.load_state_dict(state)
        return video
