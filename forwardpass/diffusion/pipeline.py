"""Text → image: text-encoder pass, ``steps × 1`` denoiser passes (2× batch with CFG), VAE-decoder pass.

The denoiser speaks flow matching (it predicts the velocity ``v = ε − x₀`` at ``t = σ·1000``). Schedulers of
the DDPM family (DDIM, LCM) live in a different coordinate system, ``x = √ᾱ·x₀ + √(1−ᾱ)·ε``; the two are the
same path up to a per-timestep rescaling:

    σ = √(1−ᾱ) / (√ᾱ + √(1−ᾱ)),   x_flow = x_vp / (√ᾱ + √(1−ᾱ))

so ``_denoise`` maps the scheduler's state into the model's, and the model's velocity into whatever the
scheduler asks for (ε, x₀ or v). Any scheduler therefore drives any of our denoisers. The few-step
student is a denoiser of the same class, distilled to be run by ``LCMScheduler`` in 1–4 steps with the
teacher's guidance baked in (so it runs without CFG: one batch-B pass per step).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from forwardpass.diffusion.dit import DiTTransformer2DModel
from forwardpass.diffusion.images import to_numpy, to_pil
from forwardpass.diffusion.loading import load_component, read_model_index
from forwardpass.diffusion.schedulers import Scheduler, scheduler_class
from forwardpass.diffusion.schedulers.base import _gen_device
from forwardpass.diffusion.text_encoder import PromptTokenizer, TinyTextEncoder
from forwardpass.diffusion.vae import TinyAutoencoderKL
from forwardpass.errors import MissingFileError, ValidationError

log = logging.getLogger(__name__)

OUTPUT_TYPES = ("pil", "np", "pt", "latent")
FALLBACK_DEFAULTS = {"num_inference_steps": 30, "guidance_scale": 4.0}


@dataclass
class ImagePipelineOutput:
    images: Any  # list[PIL.Image] | np.ndarray [B, H, W, C] | torch.Tensor


class ImagePipeline:
    def __init__(
        self,
        text_encoder: TinyTextEncoder,
        tokenizer: PromptTokenizer,
        transformer: DiTTransformer2DModel,
        vae: TinyAutoencoderKL,
        scheduler: Scheduler,
        defaults: dict[str, Any] | None = None,
    ):
        self.text_encoder, self.tokenizer = text_encoder.eval(), tokenizer
        self.transformer, self.vae, self.scheduler = transformer.eval(), vae.eval(), scheduler
        self.defaults = {**FALLBACK_DEFAULTS, **(defaults or {})}
        self._progress_kwargs: dict[str, Any] = {}

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, few_step: bool = False, scheduler: str | None = None,
        attention_backend: str | None = None,
    ) -> ImagePipeline:  # fmt: skip
        """Load a pipeline folder. ``few_step=True`` uses the distilled student (``student_transformer`` +
        ``student_scheduler``) instead of the teacher; ``scheduler`` swaps in another scheduler by class name."""
        root, index = read_model_index(path)
        slots = {"transformer": "transformer", "scheduler": "scheduler"}
        defaults = dict(index.get("forwardpass_defaults", {}))
        if few_step:
            absent = [s for s in ("student_transformer", "student_scheduler") if s not in index]
            if absent:
                raise MissingFileError(f"{root} has no few-step student (model_index.json lacks {absent})")
            slots = {"transformer": "student_transformer", "scheduler": "student_scheduler"}
            defaults.update(index.get("forwardpass_few_step_defaults", {}))
        text_encoder = load_component(root, index, "text_encoder")
        max_length = text_encoder.config["max_position_embeddings"]
        pipe = cls(
            text_encoder=text_encoder,
            tokenizer=load_component(root, index, "tokenizer", max_length=max_length),
            transformer=load_component(root, index, slots["transformer"]),
            vae=load_component(root, index, "vae"),
            scheduler=load_component(root, index, slots["scheduler"]),
            defaults=defaults,
        )
        if scheduler is not None:
            pipe.set_scheduler(scheduler)
        if attention_backend is not None:
            pipe.set_attention_backend(attention_backend)
        return pipe

    def set_scheduler(self, name: str, **config: Any) -> None:
        """Swap the scheduler by class name (``"DDIMScheduler"``) or alias (``"ddim"``); unknown → ConfigError."""
        self.scheduler = scheduler_class(name)(**config)

    def set_attention_backend(self, name: str) -> None:
        from forwardpass.attention import get_backend

        get_backend(name)  # validates the name
        for module in (*self.text_encoder.modules(), *self.transformer.modules()):
            if hasattr(module, "backend"):
                module.backend = name

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters(), torch.empty(0)).device

    def to(self, device: str | torch.device) -> ImagePipeline:
        """Move the networks (not the schedulers, whose per-step scalars broadcast from the CPU)."""
        for module in (self.text_encoder, self.transformer, self.vae):
            module.to(device)
        return self

    def set_progress_bar_config(self, **kwargs: Any) -> None:
        self._progress_kwargs = kwargs

    @property
    def vae_scale_factor(self) -> int:
        return self.vae.downsample_factor

    @property
    def size_multiple(self) -> int:
        """Height and width must be multiples of this: VAE factor × DiT patch size."""
        return self.vae.downsample_factor * self.transformer.config["patch_size"]

    # ------------------------------------------------------------------ pieces
    @torch.no_grad()
    def encode_prompt(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts → (hidden states ``[B, L, D]``, mask ``[B, L]``)."""
        ids, mask = self.tokenizer(prompts)
        ids, mask = ids.to(self.device), mask.to(self.device)
        return self.text_encoder(ids, mask), mask

    def _denoise(
        self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """One denoiser pass, in the scheduler's coordinates (see the module docstring)."""
        b = x.shape[0]
        if self.scheduler.space == "flow":
            return self.transformer(x, t.float().reshape(1).expand(b).to(x.device), context, mask)
        ab = self.scheduler.alphas_cumprod[int(t)]
        a, s = ab.sqrt(), (1 - ab).sqrt()
        sigma = s / (a + s)
        x_flow = x / (a + s)
        v = self.transformer(x_flow, (sigma * 1000).reshape(1).expand(b).to(x.device), context, mask)
        x0, eps = x_flow - sigma * v, x_flow + (1 - sigma) * v
        kind = self.scheduler.config["prediction_type"]
        if kind == "sample":
            return x0
        if kind == "epsilon":
            return eps
        return a * eps - s * x0  # v_prediction

    # ------------------------------------------------------------------ call
    def _validate(
        self, prompts, negative, steps, guidance, height, width, num_images, output_type, generator, seed
    ):
        if not prompts or any(not isinstance(p, str) for p in prompts):
            raise ValidationError("prompt must be a string or a non-empty list of strings", param="prompt")
        if any(not p.strip() for p in prompts):
            raise ValidationError(
                "prompt is empty: this model is text-conditioned; describe the image (e.g. 'a handwritten 7')",
                param="prompt",
            )
        if negative is not None and len(negative) != len(prompts):
            raise ValidationError(
                f"negative_prompt has {len(negative)} entries but prompt has {len(prompts)}",
                param="negative_prompt",
            )
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValidationError(
                f"num_inference_steps must be an integer >= 1, got {steps!r}", param="num_inference_steps"
            )
        if not isinstance(guidance, (int, float)) or not guidance >= 0:  # also rejects NaN
            raise ValidationError(f"guidance_scale must be >= 0 (1 disables guidance), got {guidance!r}",
                                  param="guidance_scale")  # fmt: skip
        m = self.size_multiple
        for name, v in (("height", height), ("width", width)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0 or v % m:
                raise ValidationError(
                    f"{name}={v!r} must be a positive multiple of {m} (VAE factor {self.vae_scale_factor} × "
                    f"DiT patch size {self.transformer.config['patch_size']}), e.g. {self.vae.config['sample_size']}",
                    param=name,
                )
        if isinstance(num_images, bool) or not isinstance(num_images, int) or num_images < 1:
            raise ValidationError(f"num_images_per_prompt must be an integer >= 1, got {num_images!r}",
                                  param="num_images_per_prompt")  # fmt: skip
        if output_type not in OUTPUT_TYPES:
            raise ValidationError(
                f"output_type must be one of {OUTPUT_TYPES}, got {output_type!r}", param="output_type"
            )
        if generator is not None and seed is not None:
            raise ValidationError("pass either generator or seed, not both", param="seed")

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str],
        negative_prompt: str | list[str] | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        height: int | None = None,
        width: int | None = None,
        num_images_per_prompt: int = 1,
        generator: torch.Generator | None = None,
        seed: int | None = None,
        output_type: str = "pil",
        latents: torch.Tensor | None = None,
        callback_on_step_end: Callable[..., dict[str, Any] | None] | None = None,
        show_progress: bool = True,
        return_dict: bool = True,
    ):
        prompts = [prompt] if isinstance(prompt, str) else list(prompt or [])
        negative = [negative_prompt] * len(prompts) if isinstance(negative_prompt, str) else negative_prompt
        steps = self.defaults["num_inference_steps"] if num_inference_steps is None else num_inference_steps
        guidance = self.defaults["guidance_scale"] if guidance_scale is None else guidance_scale
        default_size = self.vae.config["sample_size"]
        height = self.defaults.get("height", default_size) if height is None else height
        width = self.defaults.get("width", default_size) if width is None else width
        self._validate(prompts, negative, steps, guidance, height, width, num_images_per_prompt, output_type,
                       generator, seed)  # fmt: skip
        for p in prompts:
            unknown = self.tokenizer.unknown_words(p)
            if unknown:
                log.warning(
                    "prompt %r: words %s are not in the model's vocabulary and are ignored", p, unknown
                )
        if seed is not None:
            generator = torch.Generator().manual_seed(int(seed))

        # 1. text: the negative (unconditional) half first, then the conditional half, as one batch.
        prompts = [p for p in prompts for _ in range(num_images_per_prompt)]
        batch = len(prompts)
        do_cfg = guidance > 1.0
        if do_cfg:
            negs = [
                n
                for n in (negative or [""] * (batch // num_images_per_prompt))
                for _ in range(num_images_per_prompt)
            ]
            context, mask = self.encode_prompt(negs + prompts)
        else:
            context, mask = self.encode_prompt(prompts)

        # 2. initial noise
        shape = (batch, self.transformer.config["in_channels"], height // self.vae_scale_factor,
                 width // self.vae_scale_factor)  # fmt: skip
        if latents is None:
            latents = (
                # Noise is drawn on the generator's device (the CPU by default) and then moved, so a seed
                # gives the same image on any device, as diffusers' randn_tensor does.
                torch.randn(shape, generator=generator, device=_gen_device(generator)).to(self.device)
                * self.scheduler.init_noise_sigma
            )
        elif tuple(latents.shape) != shape:
            raise ValidationError(
                f"latents must have shape {shape}, got {tuple(latents.shape)}", param="latents"
            )
        else:
            latents = latents.to(self.device, torch.float32)

        # 3. denoising loop: one denoiser call per step (batch 2B with CFG, B without)
        self.scheduler.set_timesteps(steps)
        timesteps = self.scheduler.timesteps
        bar_kwargs = {"desc": "denoising", "disable": not show_progress, **self._progress_kwargs}
        bar = tqdm(total=len(timesteps), **bar_kwargs)
        for i, t in enumerate(timesteps):
            x_in = torch.cat([latents, latents]) if do_cfg else latents
            x_in = self.scheduler.scale_model_input(x_in, t)
            out = self._denoise(x_in, t, context, mask)
            if do_cfg:
                uncond, cond = out.chunk(2)
                out = uncond + guidance * (cond - uncond)
            latents = self.scheduler.step(out, t, latents, generator=generator).prev_sample
            if callback_on_step_end is not None:
                result = callback_on_step_end(self, i, t, {"latents": latents})
                if result and "latents" in result:
                    latents = result["latents"]
            bar.update(1)
        bar.close()

        # 4. decode
        if output_type == "latent":
            images: Any = latents
        else:
            pixels = self.vae.decode(latents)
            if output_type == "pt":
                images = (pixels.clamp(-1, 1) + 1) / 2
            else:
                images = to_numpy(pixels)
                if output_type == "pil":
                    images = to_pil(images)
        return ImagePipelineOutput(images=images) if return_dict else (images,)
