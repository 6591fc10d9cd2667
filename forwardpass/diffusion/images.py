"""Tensor ↔ image conversions and the grid used by the CLI and the README."""

from __future__ import annotations

import numpy as np
import torch


def to_numpy(images: torch.Tensor) -> np.ndarray:
    """Decoder output in about [-1, 1], ``[B, C, H, W]`` → float32 ``[B, H, W, C]`` in
    [0, 1] (diffusers' "np")."""
    return ((images.float().clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 1).cpu().numpy()


def to_pil(images: np.ndarray) -> list:
    from PIL import Image

    out = []
    for img in (images * 255).round().astype(np.uint8):
        out.append(Image.fromarray(img[..., 0], mode="L") if img.shape[-1] == 1 else Image.fromarray(img))
    return out


def grid_shape(n: int) -> tuple[int, int]:
    """``(rows, cols)`` for ``n`` images with no empty cell, as square as that allows (cols ≥ rows): 16 → 4×4,
    8 → 2×4, 6 → 2×3, 7 → 1×7."""
    if n < 1:
        raise ValueError(f"a grid needs at least one image, got {n}")
    rows = max(r for r in range(1, int(n**0.5) + 1) if n % r == 0)
    return rows, n // rows


GUTTER = 128  # mid grey: visible between white-on-black digits, and between black-on-white images too


def make_image_grid(images: list, rows: int | None = None, cols: int | None = None, pad: int = 2):
    """Paste PIL images into a ``rows × cols`` grid (default: ``grid_shape``) with a mid-grey
    gutter of ``pad`` pixels."""
    from PIL import Image

    if rows is None or cols is None:
        rows, cols = grid_shape(len(images))
    if len(images) > rows * cols:
        raise ValueError(f"{len(images)} images do not fit a {rows}×{cols} grid")
    w, h = images[0].size
    fill = GUTTER if images[0].mode == "L" else (GUTTER,) * len(images[0].getbands())
    grid = Image.new(images[0].mode, (cols * w + (cols + 1) * pad, rows * h + (rows + 1) * pad), fill)
    for i, img in enumerate(images):
        r, c = divmod(i, cols)
        grid.paste(img, (pad + c * (w + pad), pad + r * (h + pad)))
    return grid
