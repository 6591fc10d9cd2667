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
from forwardpass.errors import ConfigError, MissingFileError, ValidationError
from forwardpass.threads import with_own_threads

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
        num_threads: int | None = None,
    ):
        from forwardpass.threads import check_threads

        # CPU threads of each call (forwardpass/threads.py); None: small_model_threads (1 for the embedded
        # models, as `forwardpass image`), else the process's default
        self.num_threads = check_threads(num_threads, "num_threads")
        self.text_encoder, self.tokenizer = text_encoder.eval(), tokenizer
        self.transformer, self.vae, self.scheduler = transformer.eval(), vae.eval(), scheduler
        self.defaults = {**FALLBACK_DEFAULTS, **(defaults or {})}
        self._progress_kwargs: dict[str, Any] = {}
        self._check_scheduler()

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, few_step: bool = False, scheduler: str | None = None,
        attention_backend: str | None = None, num_threads: int | None = None,
    ) -> ImagePipeline:  # fmt: skip
        """Load a pipeline folder. ``few_step=True`` uses the distilled student (``student_transformer`` +
        ``student_scheduler``) instead of the teacher; ``scheduler`` swaps in another
        scheduler by class name."""
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
            num_threads=num_threads,
        )
        if scheduler is not None:
            pipe.set_scheduler(scheduler)
        if attention_backend is not None:
            pipe.set_attention_backend(attention_backend)
        return pipe

    def set_scheduler(self, name: str, **config: Any) -> None:
        """Swap the scheduler by class name (``"DDIMScheduler"``) or alias (``"ddim"``); unknown →
        ConfigError.

        It is configured for this denoiser's ``prediction_type`` (``Scheduler.for_model``: e.g. on the flow
        model DDIM gets no x̂₀ clipping, a zero-terminal-SNR table and trailing timesteps); ``config``
        overrides single settings."""
        self.scheduler = scheduler_class(name).for_model(self.model_prediction, **config)
        self._check_scheduler()

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

    def thread_count(self) -> int | None:
        """The threads each call computes with: ``num_threads``, else ``threads.small_model_threads``."""
        from forwardpass.threads import small_model_threads

        return self.num_threads or small_model_threads(self.transformer)

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

    @property
    def model_prediction(self) -> str:
        """What the denoiser predicts (its config's ``prediction_type``): ``"flow"`` (velocity ε − x₀),
        ``"epsilon"``, ``"sample"`` or ``"v_prediction"``."""
        return self.transformer.config.get("prediction_type", "flow")

    def _guided(
        self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor, mask: torch.Tensor, guidance: float,
        rescale: float, branches: int = 2, extra_inputs: tuple[torch.Tensor, ...] = (),
    ) -> torch.Tensor:
        """One denoiser pass (batch 2B with CFG), guided, in the scheduler's coordinates.

        Guidance is applied to the model's own prediction, before any conversion, so a guidance scale
        means the same with every scheduler. ``rescale`` is diffusers' ``guidance_rescale`` (Lin et al.
        2023, §3.4): the guided prediction is scaled back to the per-image standard deviation of the
        conditional one and mixed in with weight ``rescale``, which keeps high guidance scales from
        pushing the sample off the data manifold (over-saturated, broken strokes).

        ``branches == 3`` is the ``negative_mode="perp"`` batch ``[empty | negative | prompt]``: the prompt is
        guided against the empty prompt, and the negative prompt pushes away only along what it does *not*
        share with the prompt (its direction minus its projection on the prompt's; Perp-Neg, Armandpour et
        al. 2023). With the usual formula (the negative replaces the empty prompt) a negative that shares
        strokes with the prompt ("9" vs "4") erases those strokes too.
        """
        b = x.shape[0] // branches
        sched = self.scheduler
        flow_model = self.model_prediction == "flow"
        if sched.space == "flow" or not flow_model:
            x_model, t_model = x, t.float()
        else:  # a VP scheduler driving a flow model: map its state into the model's (module docstring)
            ab = sched.alphas_cumprod[int(t)]
            a, s = ab.sqrt(), (1 - ab).sqrt()
            sigma = s / (a + s)
            x_model, t_model = x / (a + s), sigma * 1000
        out = self.transformer(x_model, t_model.reshape(1).expand(x.shape[0]).to(x.device), context, mask,
                               *extra_inputs)  # e.g. the video DiT's direction
        if branches == 3:
            uncond, neg, cond = out.chunk(3)
            d_cond, d_neg = (cond - uncond).flatten(1), (neg - uncond).flatten(1)
            along = ((d_neg * d_cond).sum(1, keepdim=True)
                     / (d_cond * d_cond).sum(1, keepdim=True).clamp_min(1e-12))
            perp = (d_neg - along * d_cond).view_as(cond)
            out = uncond + guidance * (cond - uncond) - guidance * perp
        elif branches == 2:
            uncond, cond = out.chunk(2)
            out = uncond + guidance * (cond - uncond)
        if branches > 1:
            if rescale > 0:
                dims = list(range(1, out.ndim))
                std_cond, std_cfg = cond.std(dim=dims, keepdim=True), out.std(dim=dims, keepdim=True)
                out = rescale * out * (std_cond / std_cfg.clamp_min(1e-12)) + (1 - rescale) * out
            x_model = x_model[:b]
        if sched.space == "flow" or not flow_model:
            return out
        x0, eps = x_model - sigma * out, x_model + (1 - sigma) * out
        kind = sched.config["prediction_type"]
        if kind == "sample":
            return x0
        if kind == "epsilon":
            return eps
        return a * eps - s * x0  # v_prediction

    def _text_batch(self, prompts: list[str], negative: list[str] | None, per_prompt: int, guidance: float,
                    negative_mode: str) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The text conditioning of one call as a single batch, and how many branches it holds: the prompts
        (each ``per_prompt`` times); with CFG the negative (unconditional) half first, and for
        ``negative_mode="perp"`` three branches ``[empty | negative | prompt]`` (see ``_guided``).
        Words the model's vocabulary lacks are ignored, with a warning."""
        for p in prompts:
            unknown = self.tokenizer.unknown_words(p)
            if unknown:
                log.warning("prompt %r: words %s are not in the model's vocabulary and are ignored", p,
                            unknown)
        prompts = [p for p in prompts for _ in range(per_prompt)]
        batch = len(prompts)
        do_cfg = guidance > 1.0
        perp = do_cfg and negative is not None and negative_mode == "perp"
        if not do_cfg:
            return (*self.encode_prompt(prompts), 1)
        negs = [n for n in (negative or [""] * (batch // per_prompt)) for _ in range(per_prompt)]
        context, mask = self.encode_prompt(([""] * batch if perp else []) + negs + prompts)
        return context, mask, 3 if perp else 2

    def _initial_latents(self, shape: tuple[int, ...], latents: torch.Tensor | None,
                         generator: torch.Generator | None) -> torch.Tensor:
        """Fresh noise of ``shape``, or the caller's ``latents`` checked against it. Noise is drawn on the
        generator's device (the CPU by default) and then moved, so a seed gives the same result on any
        device, as diffusers' randn_tensor does."""
        if latents is None:
            noise = torch.randn(shape, generator=generator, device=_gen_device(generator)).to(self.device)
            return noise * self.scheduler.init_noise_sigma
        if tuple(latents.shape) != shape:
            raise ValidationError(f"latents must have shape {shape}, got {tuple(latents.shape)}",
                                  param="latents")
        return latents.to(self.device, torch.float32)

    def _check_scheduler(self) -> None:
        """A scheduler must be able to step this denoiser's prediction (diffusers' convention: the model
        declares ``prediction_type``; a VP scheduler on a flow model is converted, a mismatch refused)."""
        kind = self.model_prediction
        type(self.scheduler).check_model_prediction(kind)
        wanted = self.scheduler.config.get("prediction_type")
        if kind != "flow" and self.scheduler.space == "vp" and wanted != kind:
            raise ConfigError(f"{type(self.scheduler).__name__} has prediction_type={wanted!r} but the "
                              f"denoiser predicts {kind!r}; make them agree")
        if kind == "flow" and self.scheduler.config.get("clip_sample"):
            log.warning("%s clips x̂₀ to ±%g, but this model's latents are not bounded: expect broken images "
                        "(set clip_sample=False)", type(self.scheduler).__name__,
                        self.scheduler.config.get("clip_sample_range", 1.0))

    # ------------------------------------------------------------------ call
    def _validate(
        self, prompts, negative, steps, guidance, height, width, num_images, output_type, generator, seed
    ):
        if not prompts or any(not isinstance(p, str) for p in prompts):
            raise ValidationError("prompt must be a string or a non-empty list of strings", param="prompt")
        if any(not p.strip() for p in prompts):
            raise ValidationError(
                "prompt is empty: this model is text-conditioned; describe the image (e.g. 'a handwritten "
                "7')",
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
                    f"DiT patch size {self.transformer.config['patch_size']}), e.g. "
                    f"{self.vae.config['sample_size']}", param=name,
                )
        trained = [tuple(size) for size in self.defaults.get("trained_sizes") or ()]
        if trained and (width, height) not in trained:
            sizes = ", ".join(f"{w}x{h}" for w, h in trained)
            raise ValidationError(
                f"this model was trained on {sizes} images only (model_index.json trained_sizes, as width x "
                f"height); at {width}x{height} it does not draw a larger image, just a small one somewhere "
                f"inside it. Generate at {sizes} and resize the result if you need it larger", param="size")
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
    @with_own_threads  # num_threads for the call, restored after it (forwardpass/threads.py)
    def __call__(
        self,
        prompt: str | list[str],
        negative_prompt: str | list[str] | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        guidance_rescale: float | None = None,
        negative_mode: str | None = None,
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
        if guidance_rescale is None:
            guidance_rescale = self.defaults.get("guidance_rescale", 0.0)
        if negative_mode is None:
            negative_mode = self.defaults.get("negative_mode", "replace")
        if negative_mode not in ("replace", "perp"):
            raise ValidationError(f"negative_mode must be 'replace' or 'perp', got {negative_mode!r}",
                                  param="negative_mode")
        default_size = self.vae.config["sample_size"]
        height = self.defaults.get("height", default_size) if height is None else height
        width = self.defaults.get("width", default_size) if width is None else width
        self._validate(prompts, negative, steps, guidance, height, width, num_images_per_prompt, output_type,
                       generator, seed)  # fmt: skip
        _check_rescale(guidance_rescale)
        self._check_scheduler()
        if seed is not None:
            generator = torch.Generator().manual_seed(int(seed))

        # 1. text: the negative (unconditional) half first, then the conditional half, as one batch.
        context, mask, branches = self._text_batch(prompts, negative, num_images_per_prompt, guidance,
                                                   negative_mode)
        batch = len(prompts) * num_images_per_prompt

        # 2. initial noise
        shape = (batch, self.transformer.config["in_channels"], height // self.vae_scale_factor,
                 width // self.vae_scale_factor)  # fmt: skip
        latents = self._initial_latents(shape, latents, generator)

        # 3. denoising loop: one denoiser call per step (batch 2B with CFG, B without)
        self.scheduler.set_timesteps(steps)
        timesteps = self.scheduler.timesteps
        bar_kwargs = {"desc": "denoising", "disable": not show_progress, **self._progress_kwargs}
        bar = tqdm(total=len(timesteps), **bar_kwargs)
        for i, t in enumerate(timesteps):
            x_in = torch.cat([latents] * branches) if branches > 1 else latents
            x_in = self.scheduler.scale_model_input(x_in, t)
            out = self._guided(x_in, t, context, mask, guidance, guidance_rescale, branches)
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


def _check_rescale(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValidationError(f"guidance_rescale must be in [0, 1], got {value!r}", param="guidance_rescale")
