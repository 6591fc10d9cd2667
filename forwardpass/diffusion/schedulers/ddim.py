"""DDIM (Song et al. 2021; ``DDIMScheduler`` in diffusers): deterministic (eta = 0) or partly stochastic
sampling on the DDPM noise table.

From the model output it forms x̂₀ and ε̂, then jumps to the previous timestep:
``x_{t'} = √ᾱ_{t'}·x̂₀ + √(1 − ᾱ_{t'} − σ_t²)·ε̂ + σ_t·z`` with ``σ_t = eta·√var(t, t')``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch

from forwardpass.diffusion.schedulers.base import SchedulerOutput, VPScheduler, _gen_device
from forwardpass.errors import ConfigError, ValidationError


class DDIMScheduler(VPScheduler):
    DEFAULTS: ClassVar[dict[str, Any]] = {
        "num_train_timesteps": 1000,
        "beta_start": 0.0001,
        "beta_end": 0.02,
        "beta_schedule": "linear",
        "trained_betas": None,
        "clip_sample": True,
        "set_alpha_to_one": True,
        "steps_offset": 0,
        "prediction_type": "epsilon",
        "thresholding": False,
        "dynamic_thresholding_ratio": 0.995,
        "clip_sample_range": 1.0,
        "sample_max_value": 1.0,
        "timestep_spacing": "leading",
        "rescale_betas_zero_snr": False,
    }
    UNSUPPORTED: ClassVar[dict[str, Any]] = {"thresholding": False}
    # "trailing" starts at t = 999 (the pure-noise end of the zero-SNR table), as the flow schedule does.
    FLOW_MODEL_CONFIG: ClassVar[dict[str, Any]] = {**VPScheduler.FLOW_MODEL_CONFIG,
                                                   "timestep_spacing": "trailing"}

    def set_timesteps(self, num_inference_steps: int, device=None) -> None:
        n = self.config["num_train_timesteps"]
        if num_inference_steps < 1:
            raise ValidationError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
        if num_inference_steps > n:
            raise ValidationError(
                f"num_inference_steps ({num_inference_steps}) cannot exceed num_train_timesteps ({n})"
            )
        self.num_inference_steps = num_inference_steps
        spacing = self.config["timestep_spacing"]
        if spacing == "linspace":
            ts = np.linspace(0, n - 1, num_inference_steps).round()[::-1].copy().astype(np.int64)
        elif spacing == "leading":
            ratio = n // num_inference_steps
            ts = (np.arange(0, num_inference_steps) * ratio).round()[::-1].copy().astype(np.int64)
            ts += self.config["steps_offset"]
        elif spacing == "trailing":
            ratio = n / num_inference_steps
            ts = np.round(np.arange(n, 0, -ratio)).astype(np.int64) - 1
        else:
            raise ConfigError(f"timestep_spacing {spacing!r} must be 'linspace', 'leading' or 'trailing'")
        self.timesteps = torch.from_numpy(ts).to(device)
        self._step_index = None

    def _variance(self, t: int, prev_t: int) -> torch.Tensor:
        a_t = self.alphas_cumprod[t]
        a_prev = self.alphas_cumprod[prev_t] if prev_t >= 0 else self.final_alpha_cumprod
        return ((1 - a_prev) / (1 - a_t)) * (1 - a_t / a_prev)

    def step(self, model_output: torch.Tensor, timestep, sample: torch.Tensor, eta: float = 0.0,
             use_clipped_model_output: bool = False, generator: torch.Generator | None = None,
             variance_noise: torch.Tensor | None = None, return_dict: bool = True):  # fmt: skip
        if self.num_inference_steps is None:
            raise ConfigError("call set_timesteps before step")
        t = int(timestep)
        prev_t = t - self.config["num_train_timesteps"] // self.num_inference_steps
        a_t = self.alphas_cumprod[t]
        a_prev = self.alphas_cumprod[prev_t] if prev_t >= 0 else self.final_alpha_cumprod
        b_t = 1 - a_t
        x0 = self._pred_x0(model_output, sample, a_t)
        kind = self.config["prediction_type"]
        if kind == "epsilon":
            eps = model_output
        elif kind == "sample":
            eps = (sample - a_t ** (0.5) * x0) / b_t ** (0.5)
        else:
            eps = (a_t**0.5) * model_output + (b_t**0.5) * sample
        x0 = self._clip(x0)
        std = eta * self._variance(t, prev_t) ** 0.5
        if use_clipped_model_output:
            eps = (sample - a_t ** (0.5) * x0) / b_t ** (0.5)
        prev = a_prev ** (0.5) * x0 + (1 - a_prev - std**2) ** (0.5) * eps
        if eta > 0:
            if variance_noise is None:
                variance_noise = torch.randn(
                    model_output.shape, generator=generator, device=_gen_device(generator)
                )
                variance_noise = variance_noise.to(model_output.device, model_output.dtype)
            prev = prev + std * variance_noise
        return SchedulerOutput(prev, x0) if return_dict else (prev, x0)
