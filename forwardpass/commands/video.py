"""``forwardpass video "a handwritten 3 moving left" -o clip.gif``: text → clip with the embedded
moving-digits model (or --model DIR). ``--framewise`` runs the frame-by-frame baseline
instead of the whole clip."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser("video", help="generate a short video clip from a text prompt",
                              description="Generate a clip with a video diffusion pipeline: text encoder → "
                              "video DiT over all frames' latents at once → the image VAE per "
                              "frame.")  # fmt: skip
    p.add_argument("prompt", help='what to show, e.g. "a handwritten 3 moving left"')
    p.add_argument(
        "-o", "--output", default="clip.gif", help="output file: .gif (Pillow) or .mp4 (needs PyAV)"
    )
    p.add_argument("--frames", type=int, default=None, help="frames in the clip (default: the model's, 8)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    p.add_argument(
        "--guidance", type=float, default=None, help="classifier-free guidance scale; 1 disables it"
    )
    p.add_argument("--negative-prompt", default=None, help="what to steer away from (used when guidance > 1)")
    p.add_argument("--seed", type=int, default=None, help="random seed (same seed → same clip)")
    p.add_argument("--framewise", action="store_true",
                   help="frame-by-frame baseline: each frame generated from the previous ones (frames × the "
                   "cost; drifts)")  # fmt: skip
    p.add_argument("--fps", type=int, default=8, help="frames per second of the file (1–60)")
    p.add_argument("--scale", type=int, default=4, help="nearest-neighbour upscale of each frame (1–16)")
    p.add_argument("--frames-dir", default=None, help="also save every frame as PNG in this folder")
    p.add_argument("--model", default=None, help="video pipeline folder or video model name "
                   "(default: moving-digits, the embedded model)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--threads", type=int, default=1, help="CPU threads for torch (default 1)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    import torch

    from forwardpass.commands._common import check_device
    from forwardpass.diffusion.video import DEFAULT_VIDEO_MODEL_DIR
    from forwardpass.diffusion.video.export import encode_video, video_format
    from forwardpass.diffusion.video.pipeline import VideoPipeline
    from forwardpass.errors import ValidationError

    fmt = video_format(args.output)  # before the model loads: a wrong suffix fails at once
    for name, value, lo, hi in (("threads", args.threads, 1, 256), ("fps", args.fps, 1, 60),
                                ("scale", args.scale, 1, 16)):  # fmt: skip
        if not lo <= value <= hi:
            raise ValidationError(f"--{name} must be in [{lo}, {hi}], got {value}", param=name)
    if fmt == "mp4":
        import importlib.util

        if importlib.util.find_spec("av") is None:
            from forwardpass.errors import ConfigError

            raise ConfigError("MP4 output needs PyAV (`pip install av`); or write a .gif, which needs "
                              "nothing extra", param="output")  # fmt: skip
    torch.set_num_threads(args.threads)
    device = check_device(args.device)
    from forwardpass.registry import resolve_model

    folder = DEFAULT_VIDEO_MODEL_DIR if args.model is None else resolve_model(args.model, kinds=("video",))
    pipe = VideoPipeline.from_pretrained(folder, num_threads=args.threads).to(device)
    start = time.perf_counter()
    frames = pipe(args.prompt, negative_prompt=args.negative_prompt, num_frames=args.frames,
                  num_inference_steps=args.steps, guidance_scale=args.guidance, seed=args.seed,
                  framewise=args.framewise, show_progress=not args.no_progress).frames[0]  # fmt: skip
    elapsed = time.perf_counter() - start
    Path(args.output).write_bytes(encode_video(frames, fmt, fps=args.fps, scale=args.scale))
    if args.frames_dir:
        folder = Path(args.frames_dir)
        folder.mkdir(parents=True, exist_ok=True)
        for i, frame in enumerate(frames):
            frame.save(folder / f"frame_{i:02d}.png")
    mode = "frame by frame" if args.framewise else "whole clip"
    print(f"wrote {args.output} ({len(frames)} frames, {mode}, {elapsed:.2f} s)")
    return 0
