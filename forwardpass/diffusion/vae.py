"""A small convolutional VAE (the diffusers ``AutoencoderKL`` shape, shrunk for 32×32 digits).

The encoder halves the resolution ``len(block_out_channels) - 1`` times and emits a Gaussian posterior
(mean, log-variance) per latent pixel; the decoder mirrors it. Diffusion runs on
``(z - shift_factor) * scaling_factor`` so the denoiser sees latents of roughly unit variance, exactly
as Stable Diffusion does; ``decode`` undoes that scaling itself so callers never forget it.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from forwardpass.diffusion.modeling import ConfigModule


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(8, channels), channels)


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm1, self.conv1 = _norm(cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2, self.conv2 = _norm(cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return self.skip(x) + h


class Encoder(nn.Module):
    def __init__(self, in_channels: int, latent_channels: int, channels: list[int]):
        super().__init__()
        self.conv_in = nn.Conv2d(in_channels, channels[0], 3, padding=1)
        blocks: list[nn.Module] = []
        for i, c in enumerate(channels):
            blocks.append(ResBlock(channels[max(i - 1, 0)], c))
            if i < len(channels) - 1:
                blocks.append(nn.Conv2d(c, c, 3, stride=2, padding=1))  # downsample by 2
        self.blocks = nn.Sequential(*blocks)
        self.norm_out = _norm(channels[-1])
        self.conv_out = nn.Conv2d(channels[-1], 2 * latent_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv_out(F.silu(self.norm_out(self.blocks(self.conv_in(x)))))


class Decoder(nn.Module):
    def __init__(self, out_channels: int, latent_channels: int, channels: list[int]):
        super().__init__()
        rev = channels[::-1]
        self.conv_in = nn.Conv2d(latent_channels, rev[0], 3, padding=1)
        blocks: list[nn.Module] = []
        for i, c in enumerate(rev):
            blocks.append(ResBlock(rev[max(i - 1, 0)], c))
            if i < len(rev) - 1:
                blocks.append(nn.Upsample(scale_factor=2, mode="nearest"))
                blocks.append(nn.Conv2d(c, c, 3, padding=1))
        self.blocks = nn.Sequential(*blocks)
        self.norm_out = _norm(rev[-1])
        self.conv_out = nn.Conv2d(rev[-1], out_channels, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.conv_out(F.silu(self.norm_out(self.blocks(self.conv_in(z)))))


class DiagonalGaussian:
    """The encoder's posterior q(z|x) = N(mean, exp(logvar))."""

    def __init__(self, moments: torch.Tensor):
        self.mean, logvar = moments.chunk(2, dim=1)
        self.logvar = logvar.clamp(-30.0, 20.0)

    def sample(self, generator: torch.Generator | None = None) -> torch.Tensor:
        noise = torch.randn(
            self.mean.shape, generator=generator, dtype=self.mean.dtype, device=self.mean.device
        )
        return self.mean + torch.exp(0.5 * self.logvar) * noise

    def mode(self) -> torch.Tensor:
        return self.mean

    def kl(self) -> torch.Tensor:
        """KL(q || N(0, 1)) summed over latent elements, per sample."""
        return 0.5 * (self.mean.pow(2) + self.logvar.exp() - 1.0 - self.logvar).flatten(1).sum(1)


class TinyAutoencoderKL(ConfigModule):
    DEFAULTS: ClassVar[dict[str, Any]] = {
        "in_channels": 1,
        "out_channels": 1,
        "latent_channels": 4,
        "block_out_channels": [32, 64, 64],
        "scaling_factor": 1.0,
        "shift_factor": 0.0,
        "sample_size": 32,
    }

    def __init__(self, **config):
        super().__init__(**config)
        c = self.config
        chans = list(c["block_out_channels"])
        self.encoder = Encoder(c["in_channels"], c["latent_channels"], chans)
        self.decoder = Decoder(c["out_channels"], c["latent_channels"], chans)

    @property
    def downsample_factor(self) -> int:
        """Image pixels per latent pixel along each side (the "latent factor")."""
        return 2 ** (len(self.config["block_out_channels"]) - 1)

    def encode(self, images: torch.Tensor) -> DiagonalGaussian:
        """``images`` in [-1, 1], ``[B, C, H, W]`` → posterior over *unscaled* latents."""
        return DiagonalGaussian(self.encoder(images))

    def scale_latents(self, z: torch.Tensor) -> torch.Tensor:
        return (z - self.config["shift_factor"]) * self.config["scaling_factor"]

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """*Scaled* latents (what the denoiser produces) → images in about [-1, 1]."""
        z = latents / self.config["scaling_factor"] + self.config["shift_factor"]
        return self.decoder(z)
