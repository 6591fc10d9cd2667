"""Text → video: the image pipeline's pieces around a video DiT that denoises the whole clip at once.

``VideoPipeline`` reuses ``ImagePipeline`` for loading, prompt encoding, scheduler swaps and guidance
(``_guided`` is shape-agnostic: the clip ``[B, F, C, h, w]`` is just a bigger latent). What it adds:

* whole-clip sampling (the default): every step updates all frames together, each frame's tokens
  attending to every other frame's, so one digit and one trajectory are decided jointly;
* ``framewise=True``, the frame-by-frame baseline: the same network run autoregressively. Frame ``k`` is
  denoised on its own schedule while frames ``< k`` are the already generated (clean, σ = 0) frames and
  frames ``> k`` pure noise (σ = 1), the form it was also trained in. Errors in a generated frame become the
  next frame's context, which is how frame-by-frame generation drifts. It costs ``F×`` the denoiser passes.

Each step with CFG is one denoiser call on a batch of ``2B`` (``3B`` with a ``perp`` negative prompt). A DiT
with ``num_directions`` also gets each text row's direction (``moving_digits.direction_index`` of that row's
prompt, negative or empty prompt), so CFG guides towards the prompted direction as it does towards the digit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from forwardpass.diffusion.images import to_numpy, to_pil
from forwardpass.diffusion.loading import MODEL_CLASSES
from forwardpass.diffusion.pipeline import ImagePipeline, _check_rescale
from forwardpass.diffusion.video.dit import VideoDiTModel
from forwardpass.diffusion.video.moving_digits import direction_index
from forwardpass.errors import ConfigError, ValidationError
from forwardpass.threads import with_own_threads

log = logging.getLogger(__name__)


# model_index.json names the denoiser class; make ours loadable by the shared component loader.
MODEL_CLASSES.setdefault("VideoDiTModel", VideoDiTModel)

OUTPUT_TYPES = ("pil", "np", "pt", "latent")
MAX_FRAMES = 16  # the DiT's temporal positions are sin-cos, but the default model is only trained at 8


@dataclass
class VideoPipelineOutput:
    frames: Any  # list (per video) of lists of PIL images | np.ndarray [B, F, H, W, C] | torch.Tensor


class VideoPipeline(ImagePipeline):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if not isinstance(self.transformer, VideoDiTModel):
            raise ConfigError("VideoPipeline needs a VideoDiTModel transformer, got "
                              f"{type(self.transformer).__name__} (is this an image model folder? use "
                              "ImagePipeline)")  # fmt: skip

    def _check_call(self, num_frames: int, num_videos: int, output_type: str) -> None:
        if (
            isinstance(num_frames, bool)
            or not isinstance(num_frames, int)
            or not 1 <= num_frames <= MAX_FRAMES
        ):
            raise ValidationError(f"num_frames must be an integer in [1, {MAX_FRAMES}], got {num_frames!r}",
                                  param="num_frames")  # fmt: skip
        pt = self.transformer.config["patch_size_t"]
        if num_frames % pt:
            raise ValidationError(
                f"num_frames must be a multiple of the temporal patch size {pt}", param="num_frames"
            )
        trained = self.defaults.get("trained_frames")
        if trained and num_frames not in trained:
            log.warning("this model was trained on clips of %s frames; %d frames may lose the digit or the "
                        "motion", trained, num_frames)  # fmt: skip
        if isinstance(num_videos, bool) or not isinstance(num_videos, int) or num_videos < 1:
            raise ValidationError(f"num_videos_per_prompt must be an integer >= 1, got {num_videos!r}",
                                  param="num_videos_per_prompt")  # fmt: skip
        if output_type not in OUTPUT_TYPES:
            raise ValidationError(f"output_type must be one of {OUTPUT_TYPES}, got {output_type!r}",
                                  param="output_type")  # fmt: skip

    @torch.no_grad()
    @with_own_threads  # num_threads for the call, restored after it (forwardpass/threads.py)
    def __call__(  # type: ignore[override]
        self,
        prompt: str | list[str],
        negative_prompt: str | list[str] | None = None,
        num_frames: int | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        guidance_rescale: float | None = None,
        negative_mode: str | None = None,
        height: int | None = None,
        width: int | None = None,
        num_videos_per_prompt: int = 1,
        generator: torch.Generator | None = None,
        seed: int | None = None,
        output_type: str = "pil",
        latents: torch.Tensor | None = None,
        framewise: bool = False,
        callback_on_step_end: Callable[..., dict[str, Any] | None] | None = None,
        show_progress: bool = True,
        return_dict: bool = True,
    ):
        prompts = [prompt] if isinstance(prompt, str) else list(prompt or [])
        negative = [negative_prompt] * len(prompts) if isinstance(negative_prompt, str) else negative_prompt
        d = self.defaults
        frames = (
            d.get("num_frames", self.transformer.config["num_frames"]) if num_frames is None else num_frames
        )
        steps = d["num_inference_steps"] if num_inference_steps is None else num_inference_steps
        guidance = d["guidance_scale"] if guidance_scale is None else guidance_scale
        rescale = d.get("guidance_rescale", 0.0) if guidance_rescale is None else guidance_rescale
        negative_mode = d.get("negative_mode", "replace") if negative_mode is None else negative_mode
        if negative_mode not in ("replace", "perp"):
            raise ValidationError(f"negative_mode must be 'replace' or 'perp', got {negative_mode!r}",
                                  param="negative_mode")  # fmt: skip
        size = self.vae.config["sample_size"]
        height = d.get("height", size) if height is None else height
        width = d.get("width", size) if width is None else width
        # The image checks (prompt, steps, guidance, size, generator/seed) hold for video unchanged.
        self._validate(prompts, negative, steps, guidance, height, width, 1, "pil", generator, seed)
        self._check_call(frames, num_videos_per_prompt, output_type)
        _check_rescale(rescale)
        if framewise and self.scheduler.space != "flow":
            raise ConfigError("framewise sampling steps each frame in flow-matching σ; use "
                              "FlowMatchEulerDiscreteScheduler", param="scheduler")  # fmt: skip
        self._check_scheduler()
        if seed is not None:
            generator = torch.Generator().manual_seed(int(seed))

        # 1. text, as for images: [negative | prompt] (or [empty | negative | prompt] for perp) in one batch
        context, mask, branches = self._text_batch(prompts, negative, num_videos_per_prompt, guidance,
                                                   negative_mode)
        batch = len(prompts) * num_videos_per_prompt
        direction = self._direction_batch(prompts, negative, num_videos_per_prompt, branches)

        # 2. noise for the whole clip, drawn on the generator's device so a seed means the same clip anywhere
        f_ = self.vae_scale_factor
        shape = (batch, frames, self.transformer.config["in_channels"], height // f_, width // f_)
        latents = self._initial_latents(shape, latents, generator)

        # 3. denoise
        total = steps * (frames if framewise else 1)
        desc = "denoising" + (" (frame by frame)" if framewise else "")
        bar = tqdm(total=total, **{"desc": desc, "disable": not show_progress, **self._progress_kwargs})
        args = (context, mask, direction, guidance, rescale, branches, generator, callback_on_step_end, bar)
        latents = (
            self._framewise(latents, steps, *args) if framewise else self._whole_clip(latents, steps, *args)
        )
        bar.close()

        # 4. decode every frame with the image VAE
        if output_type == "latent":
            return VideoPipelineOutput(frames=latents) if return_dict else (latents,)
        pixels = self.vae.decode(latents.flatten(0, 1))
        out: Any
        if output_type == "pt":
            out = ((pixels.clamp(-1, 1) + 1) / 2).view(batch, frames, *pixels.shape[1:])
        else:
            arr = to_numpy(pixels)
            arr = arr.reshape(batch, frames, *arr.shape[1:])
            out = arr if output_type == "np" else [to_pil(clip) for clip in arr]
        return VideoPipelineOutput(frames=out) if return_dict else (out,)

    def _direction_batch(self, prompts: list[str], negative: list[str] | None, per_prompt: int,
                         branches: int) -> torch.Tensor | None:  # fmt: skip
        """Each text row's direction index (``moving_digits.direction_index``), in ``_text_batch``'s order:
        ``[prompts]``, ``[negative | prompts]`` or ``[empty | negative | prompts]``; None for a model without
        a direction embedding."""
        if not self.transformer.config.get("num_directions"):
            return None
        rows = [p for p in prompts for _ in range(per_prompt)]
        if branches > 1:
            negs = [n for n in (negative or [""] * len(prompts)) for _ in range(per_prompt)]
            rows = [""] * len(rows) * (branches - 2) + negs + rows
        return torch.tensor([direction_index(r) for r in rows], device=self.device)

    # ------------------------------------------------------------------ samplers
    def _whole_clip(
        self, latents, steps, context, mask, direction, guidance, rescale, branches, generator, callback, bar
    ):
        self.scheduler.set_timesteps(steps)
        for i, t in enumerate(self.scheduler.timesteps):
            x_in = torch.cat([latents] * branches) if branches > 1 else latents
            x_in = self.scheduler.scale_model_input(x_in, t)
            extra = () if direction is None else (direction,)
            out = self._guided(x_in, t, context, mask, guidance, rescale, branches, extra)
            latents = self.scheduler.step(out, t, latents, generator=generator).prev_sample
            latents = self._after_step(callback, i, t, latents)
            bar.update(1)
        return latents

    def _framewise(
        self, latents, steps, context, mask, direction, guidance, rescale, branches, generator, callback, bar
    ):
        """Frame k from noise with frames < k fixed (σ = 0) and frames > k at their initial noise (σ = 1)."""
        batch, frames = latents.shape[:2]
        n_train = self.scheduler.config["num_train_timesteps"]
        clip = latents.clone()  # frames > k keep their pure noise until their turn
        i = 0
        for k in range(frames):
            self.scheduler.set_timesteps(steps)
            for t in self.scheduler.timesteps:
                ts = torch.full((batch, frames), float(n_train), device=clip.device)
                ts[:, :k], ts[:, k] = 0.0, t
                x_in = torch.cat([clip] * branches) if branches > 1 else clip
                extra = () if direction is None else (direction,)
                out = self.transformer(x_in, ts.repeat(branches, 1), context, mask, *extra)[:, k]
                out = guide(out, branches, guidance, rescale)
                clip[:, k] = self.scheduler.step(out, t, clip[:, k], generator=generator).prev_sample
                clip = self._after_step(callback, i, t, clip)
                i += 1
                bar.update(1)
        return clip

    def _after_step(self, callback, i: int, t, latents: torch.Tensor) -> torch.Tensor:
        if callback is None:
            return latents
        result = callback(self, i, t, {"latents": latents})
        return result["latents"] if result and "latents" in result else latents


def guide(out: torch.Tensor, branches: int, guidance: float, rescale: float) -> torch.Tensor:
    """Classifier-free guidance of a flow prediction stacked as ``[uncond | cond]`` or, for a perp negative,
    ``[empty | negative | prompt]`` (the same formulas as ``ImagePipeline._guided``)."""
    if branches == 1:
        return out
    if branches == 3:
        uncond, neg, cond = out.chunk(3)
        d_cond, d_neg = (cond - uncond).flatten(1), (neg - uncond).flatten(1)
        along = (d_neg * d_cond).sum(1, keepdim=True) / (d_cond * d_cond).sum(1, keepdim=True).clamp_min(
            1e-12
        )
        guided = uncond + guidance * (cond - uncond) - guidance * (d_neg - along * d_cond).view_as(cond)
    else:
        uncond, cond = out.chunk(2)
        guided = uncond + guidance * (cond - uncond)
    if rescale > 0:
        dims = list(range(1, guided.ndim))
        std_cond, std_cfg = cond.std(dim=dims, keepdim=True), guided.std(dim=dims, keepdim=True)
        guided = rescale * guided * (std_cond / std_cfg.clamp_min(1e-12)) + (1 - rescale) * guided
    return guided
