"""Flow-matching Euler (``FlowMatchEulerDiscreteScheduler`` in diffusers; SD3 / Flux use it).

State ``x_σ = (1 − σ)·x₀ + σ·ε``; the model predicts the velocity ``v = ε − x₀`` at ``t = σ·1000``, and one
Euler step is ``x_{σ'} = x_σ + (σ' − σ)·v``. ``shift`` bends the schedule toward high noise,
``σ ← shift·σ / (1 + (shift − 1)·σ)``, which larger images need because they keep more signal at a given σ.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch

from forwardpass.diffusion.schedulers.base import Scheduler, SchedulerOutput
from forwardpass.errors import ConfigError, ValidationError


class FlowMatchEulerDiscreteScheduler(Scheduler):
    space = "flow"
    DEFAULTS: ClassVar[dict[str, Any]] = {
        "num_train_timesteps": 1000,
        "shift": 1.0,
        "use_dynamic_shifting": False,
        "base_shift": 0.5,
        "max_shift": 1.15,
        "base_image_seq_len": 256,
        "max_image_seq_len": 4096,
        "invert_sigmas": False,
        "shift_terminal": None,
        "use_karras_sigmas": False,
        "use_exponential_sigmas": False,
        "use_beta_sigmas": False,
        "time_shift_type": "exponential",
        "stochastic_sampling": False,
    }
    UNSUPPORTED: ClassVar[dict[str, Any]] = {
        "use_dynamic_shifting": False,
        "invert_sigmas": False,
        "shift_terminal": None,
        "use_karras_sigmas": False,
        "use_exponential_sigmas": False,
        "use_beta_sigmas": False,
        "stochastic_sampling": False,
    }

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        n, shift = self.config["num_train_timesteps"], self.config["shift"]
        if shift <= 0:
            raise ConfigError(f"shift must be > 0, got {shift}")
        ts = torch.from_numpy(np.linspace(1, n, n, dtype=np.float32)[::-1].copy())
        sigmas = ts / n
        sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
        self.timesteps = sigmas * n
        self.sigmas = sigmas
        self.sigma_min = float(sigmas[-1])
        self.sigma_max = float(sigmas[0])

    def set_timesteps(
        self, num_inference_steps: int | None = None, device=None, sigmas: list[float] | None = None
    ):
        """Evenly spaced σ from σ_max to σ_min (or the given ``sigmas``), shifted, with a final σ = 0."""
        n, shift = self.config["num_train_timesteps"], self.config["shift"]
        if sigmas is None:
            if num_inference_steps is None or num_inference_steps < 1:
                raise ValidationError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
            # Same float64 arithmetic as diffusers, then float32, so results agree to the last bit.
            t = np.linspace(self.sigma_max * n, self.sigma_min * n, num_inference_steps)
            s = t / n
        else:
            s = np.array(sigmas).astype(np.float32)
        s = shift * s / (1 + (shift - 1) * s)
        s = torch.from_numpy(np.asarray(s)).to(dtype=torch.float32, device=device)
        self.num_inference_steps = len(s)
        self.timesteps = s * n
        self.sigmas = torch.cat([s, torch.zeros(1, device=s.device)])
        self._step_index = None

    def step(self, model_output: torch.Tensor, timestep, sample: torch.Tensor, generator=None,
             return_dict: bool = True):  # fmt: skip
        if self._step_index is None:
            self._init_step_index(timestep)
        sample = sample.to(torch.float32)
        sigma, sigma_next = self.sigmas[self._step_index], self.sigmas[self._step_index + 1]
        prev = (sample + (sigma_next - sigma) * model_output).to(model_output.dtype)
        self._step_index += 1
        x0 = sample - sigma * model_output
        return SchedulerOutput(prev, x0) if return_dict else (prev,)
