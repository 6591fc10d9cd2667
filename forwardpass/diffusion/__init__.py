"""Image generation: text encoder → DiT denoiser (with classifier-free guidance) → VAE decoder.

``ImagePipeline.from_pretrained(DIR)`` reads a diffusers-style folder; ``DEFAULT_MODEL_DIR`` is the small
digits model embedded in the package.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "assets" / "image"


def __getattr__(name: str):
    # Lazy, so `import forwardpass.diffusion` does not import torch.
    if name in ("ImagePipeline", "ImagePipelineOutput"):
        from forwardpass.diffusion import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'forwardpass.diffusion' has no attribute {name!r}")


__all__ = ["DEFAULT_MODEL_DIR", "ImagePipeline", "ImagePipelineOutput"]
