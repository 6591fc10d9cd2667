"""Latent Consistency Model sampling (Luo et al. 2023; ``LCMScheduler`` in diffusers).

A consistency model maps any noisy latent straight to a clean estimate x̂₀. Few-step sampling therefore
alternates "predict x̂₀" and "re-noise x̂₀ to the next (lower) timestep with fresh noise":
``x_{t'} = √ᾱ_{t'}·x̂₀ + √(1 − ᾱ_{t'})·z``; the last step returns x̂₀ itself. The timesteps are a subset of
the ``original_inference_steps``-point schedule the model was distilled on.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch

from forwardpass.diffusion.schedulers.base import SchedulerOutput, VPScheduler, _gen_device
from forwardpass.errors import ConfigError, ValidationError


class LCMScheduler(VPScheduler):
    DEFAULTS: ClassVar[dict[str, Any]] = {
        "num_train_timesteps": 1000,
        "beta_start": 0.00085,
        "beta_end": 0.012,
        "beta_schedule": "scaled_linear",
        "trained_betas": None,
        "original_inference_steps": 50,
        "clip_sample": False,
        "clip_sample_range": 1.0,
        "set_alpha_to_one": True,
        "steps_offset": 0,
        "prediction_type": "epsilon",
        "thresholding": False,
        "dynamic_thresholding_ratio": 0.995,
        "sample_max_value": 1.0,
        "timestep_spacing": "leading",
        "timestep_scaling": 10.0,
        "rescale_betas_zero_snr": False,
    }
    UNSUPPORTED: ClassVar[dict[str, Any]] = {"thresholding": False}

    def set_timesteps(
        self, num_inference_steps: int, device=None, original_inference_steps: int | None = None
    ):
        n = self.config["num_train_timesteps"]
        orig = original_inference_steps or self.config["original_inference_steps"]
        if num_inference_steps < 1:
            raise ValidationError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
        if orig > n:
            raise ConfigError(f"original_inference_steps ({orig}) cannot exceed num_train_timesteps ({n})")
        if num_inference_steps > orig:
            raise ValidationError(
                f"num_inference_steps ({num_inference_steps}) cannot exceed original_inference_steps "
                f"({orig}) for LCMScheduler: its schedule is a subset of the distillation schedule"
            )
        k = n // orig
        origin = (np.arange(1, orig + 1) * k - 1)[::-1].copy()  # the distillation schedule, high → low
        idx = np.floor(np.linspace(0, len(origin), num=num_inference_steps, endpoint=False)).astype(np.int64)
        self.num_inference_steps = num_inference_steps
        self.timesteps = torch.from_numpy(origin[idx]).to(device=device, dtype=torch.long)
        self._step_index = None

    def boundary_scalings(self, timestep: int) -> tuple[float, float]:
        """(c_skip, c_out): at t → 0 the output must equal the input (the consistency boundary condition)."""
        sigma_data = 0.5
        s = timestep * self.config["timestep_scaling"]
        return sigma_data**2 / (s**2 + sigma_data**2), s / (s**2 + sigma_data**2) ** 0.5

    def step(self, model_output: torch.Tensor, timestep, sample: torch.Tensor,
             generator: torch.Generator | None = None, return_dict: bool = True):  # fmt: skip
        if self.num_inference_steps is None:
            raise ConfigError("call set_timesteps before step")
        if self._step_index is None:
            self._init_step_index(timestep)
        nxt = self._step_index + 1
        prev_t = self.timesteps[nxt] if nxt < len(self.timesteps) else timestep
        a_t = self.alphas_cumprod[timestep]
        a_prev = self.alphas_cumprod[prev_t] if prev_t >= 0 else self.final_alpha_cumprod
        c_skip, c_out = self.boundary_scalings(timestep)
        x0 = self._clip(self._pred_x0(model_output, sample, a_t))
        denoised = c_out * x0 + c_skip * sample
        if self._step_index != self.num_inference_steps - 1:
            noise = torch.randn(model_output.shape, generator=generator, device=_gen_device(generator))
            noise = noise.to(denoised.device, denoised.dtype)
            prev = a_prev.sqrt() * denoised + (1 - a_prev).sqrt() * noise
        else:
            prev = denoised
        self._step_index += 1
        return SchedulerOutput(prev, denoised) if return_dict else (prev, denoised)
