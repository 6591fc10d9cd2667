"""Writing frames to a file: GIF with Pillow (always available), MP4 with PyAV when it is installed.

Frames are upscaled with nearest-neighbour by ``scale`` first: the default model's 32×32 frames are
too small to see at native size, and nearest keeps the pixels sharp.
"""

from __future__ import annotations

import io
from pathlib import Path

from forwardpass.errors import ConfigError, ValidationError

FORMATS = ("gif", "mp4")


def video_format(path: str | Path) -> str:
    """``"gif"`` or ``"mp4"`` from a file name, or a ``ValidationError`` naming the choices."""
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in FORMATS:
        raise ValidationError(f"{path}: the output must end in .gif or .mp4", param="output")
    return suffix


def _upscaled(frames: list, scale: int) -> list:
    from PIL import Image

    if scale == 1:
        return list(frames)
    return [f.resize((f.width * scale, f.height * scale), Image.NEAREST) for f in frames]


def encode_video(frames: list, fmt: str = "gif", *, fps: int = 8, scale: int = 1) -> bytes:
    """PIL frames → the bytes of a looping GIF or an H.264 MP4."""
    if not frames:
        raise ValidationError("a video needs at least one frame", param="frames")
    if fmt not in FORMATS:
        raise ValidationError(f"unknown video format {fmt!r}; choose one of {FORMATS}", param="format")
    frames = _upscaled(frames, scale)
    buf = io.BytesIO()
    if fmt == "gif":
        frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=round(1000 / fps),
                       loop=0)  # fmt: skip
        return buf.getvalue()
    try:
        import av
    except ImportError:
        raise ConfigError("MP4 output needs PyAV (`pip install av`); or write a .gif, which needs nothing "
                          "extra", param="output") from None  # fmt: skip
    import numpy as np

    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        # H.264 in yuv420p needs even sides; pad by one pixel if a side is odd.
        stream.width, stream.height = (
            frames[0].width + frames[0].width % 2,
            frames[0].height + frames[0].height % 2,
        )
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            rgb = np.zeros((stream.height, stream.width, 3), dtype=np.uint8)
            rgb[: frame.height, : frame.width] = np.asarray(frame.convert("RGB"))
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def export_to_video(frames: list, path: str | Path, *, fps: int = 8, scale: int = 1) -> Path:
    """Write ``frames`` to ``path`` (.gif or .mp4), diffusers' ``export_to_video`` / ``export_to_gif``."""
    path = Path(path)
    data = encode_video(frames, video_format(path), fps=fps, scale=scale)
    path.write_bytes(data)
    return path
