"""Video generation: a video DiT over per-frame VAE latents, denoising the whole clip at once.

``VideoPipeline.from_pretrained(DIR)(prompt, num_frames=8)`` returns frames, diffusers-style;
``DEFAULT_VIDEO_MODEL_DIR`` is the small moving-digits model embedded in the package.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_VIDEO_MODEL_DIR = Path(__file__).resolve().parents[2] / "assets" / "video"


def __getattr__(name: str):
    # Lazy, so importing the package does not import torch.
    if name in ("VideoPipeline", "VideoPipelineOutput"):
        from forwardpass.diffusion.video import pipeline

        return getattr(pipeline, name)
    if name == "VideoDiTModel":
        from forwardpass.diffusion.video.dit import VideoDiTModel

        return VideoDiTModel
    raise AttributeError(f"module 'forwardpass.diffusion.video' has no attribute {name!r}")


__all__ = ["DEFAULT_VIDEO_MODEL_DIR", "VideoDiTModel", "VideoPipeline", "VideoPipelineOutput"]
