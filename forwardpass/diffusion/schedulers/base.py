"""What every scheduler shares: a validated config (diffusers' ``scheduler_config.json`` fields) and the
DDPM noise table (betas → alphas_cumprod) used by DDIM and LCM.

We implement the options our pipelines use and reject the rest by name instead of silently ignoring them
(a config asking for Karras sigmas must not quietly get linear ones).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from forwardpass.errors import ConfigError


@dataclass
class SchedulerOutput:
    prev_sample: torch.Tensor
    pred_original_sample: torch.Tensor | None = None

    @property
    def denoised(self) -> torch.Tensor | None:  # LCMScheduler's name for the x₀ estimate
        return self.pred_original_sample


class Scheduler:
    #: Field → default, exactly diffusers' constructor defaults.
    DEFAULTS: ClassVar[dict[str, Any]] = {}
    #: Fields we accept only at their default value (name → the value we support).
    UNSUPPORTED: ClassVar[dict[str, Any]] = {}
    #: "flow": state is x_σ = (1−σ)x₀ + σε; "vp": state is √ᾱ x₀ + √(1−ᾱ) ε (DDPM family).
    space: ClassVar[str] = "vp"
    #: Settings this scheduler takes when it drives a denoiser that predicts the flow-matching velocity
    #: (``prediction_type = "flow"``); see ``for_model``.
    FLOW_MODEL_CONFIG: ClassVar[dict[str, Any]] = {}
    init_noise_sigma: float = 1.0
    order = 1

    def __init__(self, **kwargs: Any):
        config = dict(self.DEFAULTS)
        for key, value in kwargs.items():
            if key.startswith("_"):  # _class_name, _diffusers_version
                continue
            if key not in config:
                raise ConfigError(f"{type(self).__name__}: unknown config field {key!r}")
            config[key] = value
        for key, supported in self.UNSUPPORTED.items():
            if config[key] != supported:
                raise ConfigError(
                    f"{type(self).__name__}: {key}={config[key]!r} is not implemented (only {supported!r})"
                )
        self.config = config
        self.num_inference_steps: int | None = None
        self._step_index: int | None = None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Scheduler:
        return cls(**config)

    @classmethod
    def for_model(cls, model_prediction: str, **config: Any) -> Scheduler:
        """This scheduler, configured to drive a denoiser that predicts ``model_prediction``, as diffusers'
        ``Scheduler.from_config(pipe.scheduler.config)`` does when a scheduler is swapped: the model's
        prediction type decides the settings (``config`` overrides them), or a clear ``ConfigError``."""
        cls.check_model_prediction(model_prediction)
        base = cls.FLOW_MODEL_CONFIG if model_prediction == "flow" else {"prediction_type": model_prediction}
        return cls(**{**base, **config})

    @classmethod
    def check_model_prediction(cls, model_prediction: str) -> None:
        """Raise ``ConfigError`` unless this scheduler can step (directly or converted) such a model."""
        if cls.space == "flow" and model_prediction != "flow":
            raise ConfigError(
                f"{cls.__name__} steps a flow-matching velocity, but this denoiser predicts "
                f"{model_prediction!r}; use DDIMScheduler or LCMScheduler with that prediction_type")
        if cls.space == "vp" and model_prediction not in ("flow", "epsilon", "sample", "v_prediction"):
            raise ConfigError(f"{cls.__name__} cannot drive a denoiser that predicts {model_prediction!r}")

    def to_config(self) -> dict[str, Any]:
        return {"_class_name": type(self).__name__, **self.config}

    def scale_model_input(self, sample: torch.Tensor, timestep: Any = None) -> torch.Tensor:
        return sample

    @property
    def step_index(self) -> int | None:
        return self._step_index

    def _init_step_index(self, timestep: Any) -> None:
        # diffusers' rule: the first step looks the timestep up in the schedule (the second match if the
        # value repeats, so an img2img start never skips a sigma).
        t = timestep.item() if isinstance(timestep, torch.Tensor) else timestep
        indices = (self.timesteps == t).nonzero()
        if len(indices) == 0:
            raise ConfigError(f"timestep {t} is not in this scheduler's schedule; call set_timesteps first")
        self._step_index = int(indices[1 if len(indices) > 1 else 0].item())


def _gen_device(generator: torch.Generator | None) -> torch.device:
    """Draw noise where the generator lives (CPU unless the caller passed a CUDA generator)."""
    return generator.device if generator is not None else torch.device("cpu")


# ----- the DDPM noise table ---------------------------------------------------------------------
def _betas_for_alpha_bar(n: int, max_beta: float = 0.999) -> torch.Tensor:
    def alpha_bar(t: float) -> float:
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

    return torch.tensor([min(1 - alpha_bar((i + 1) / n) / alpha_bar(i / n), max_beta) for i in range(n)],
                        dtype=torch.float32)  # fmt: skip


def _rescale_zero_terminal_snr(betas: torch.Tensor) -> torch.Tensor:
    """Lin et al. 2023: shift √ᾱ so the last timestep has zero signal, keeping the first unchanged."""
    sqrt_ab = torch.cumprod(1.0 - betas, dim=0).sqrt()
    first, last = sqrt_ab[0].clone(), sqrt_ab[-1].clone()
    sqrt_ab -= last
    sqrt_ab *= first / (first - last)
    ab = sqrt_ab**2
    alphas = torch.cat([ab[0:1], ab[1:] / ab[:-1]])
    return 1 - alphas


class VPScheduler(Scheduler):
    """Base for DDPM-family schedulers: builds ``betas``, ``alphas_cumprod`` and ``final_alpha_cumprod``.

    On a flow-matching denoiser the pipeline converts the predicted velocity into what the scheduler asks
    for (``prediction_type``). ``FLOW_MODEL_CONFIG`` makes the schedule match the flow model's: no clipping
    of x̂₀ (latents are not bounded by ±1; clipping them draws strokes, not digits), a zero-terminal-SNR
    noise table (the first step is pure noise, σ = 1, where the flow schedule starts too) and
    ``v_prediction``, which stays finite at zero SNR where ``epsilon`` would divide by √ᾱ = 0.
    """

    space = "vp"
    FLOW_MODEL_CONFIG: ClassVar[dict[str, Any]] = {
        "clip_sample": False, "rescale_betas_zero_snr": True, "prediction_type": "v_prediction"}

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        c = self.config
        n = c["num_train_timesteps"]
        if c["trained_betas"] is not None:
            betas = torch.tensor(c["trained_betas"], dtype=torch.float32)
        elif c["beta_schedule"] == "linear":
            betas = torch.linspace(c["beta_start"], c["beta_end"], n, dtype=torch.float32)
        elif c["beta_schedule"] == "scaled_linear":  # the latent-diffusion schedule
            betas = torch.linspace(c["beta_start"] ** 0.5, c["beta_end"] ** 0.5, n, dtype=torch.float32) ** 2
        elif c["beta_schedule"] == "squaredcos_cap_v2":  # GLIDE cosine
            betas = _betas_for_alpha_bar(n)
        else:
            raise ConfigError(f"{type(self).__name__}: unknown beta_schedule {c['beta_schedule']!r}")
        if c["rescale_betas_zero_snr"]:
            betas = _rescale_zero_terminal_snr(betas)
        self.betas = betas
        self.alphas = 1.0 - betas
        self.alphas_cumprod = torch.cumprod(self.alphas, dim=0)
        # At the last step there is no "previous" ᾱ; DDIM uses 1 (a clean sample) unless told otherwise.
        self.final_alpha_cumprod = torch.tensor(1.0) if c["set_alpha_to_one"] else self.alphas_cumprod[0]
        self.timesteps = torch.arange(n - 1, -1, -1, dtype=torch.int64)

    def _pred_x0(
        self, model_output: torch.Tensor, sample: torch.Tensor, alpha_prod_t: torch.Tensor
    ) -> torch.Tensor:
        beta_prod_t = 1 - alpha_prod_t
        kind = self.config["prediction_type"]
        if kind == "epsilon":
            return (sample - beta_prod_t ** (0.5) * model_output) / alpha_prod_t ** (0.5)
        if kind == "sample":
            return model_output
        if kind == "v_prediction":
            return (alpha_prod_t**0.5) * sample - (beta_prod_t**0.5) * model_output
        raise ConfigError(f"prediction_type {kind!r} must be one of 'epsilon', 'sample', 'v_prediction'")

    def _clip(self, x0: torch.Tensor) -> torch.Tensor:
        if self.config["clip_sample"]:
            r = self.config["clip_sample_range"]
            return x0.clamp(-r, r)
        return x0
