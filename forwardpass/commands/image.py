"""``forwardpass image "a handwritten 7" -o out.png``: text → image with the embedded digits
model (or --model DIR)."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser("image", help="generate an image from a text prompt",
                              description="Generate images with a diffusion pipeline (text encoder → DiT → "
                                          "VAE).")  # fmt: skip
    p.add_argument("prompt", help='what to draw, e.g. "a handwritten 7"')
    p.add_argument("--negative-prompt", default=None, help="what to steer away from (used when guidance > 1)")
    p.add_argument("--negative-mode", choices=("perp", "replace"), default=None,
                   help="perp: push away only from what the negative prompt does not share with the prompt "
                   "(Perp-Neg; 3 denoiser branches); replace: the negative prompt takes the empty "
                   "prompt's place (diffusers' formula). Default: the model's (perp for the embedded model)")
    p.add_argument(
        "--steps", type=int, default=None, help="denoising steps (default: the model's; 4 with --few-step)"
    )
    p.add_argument(
        "--guidance", type=float, default=None, help="classifier-free guidance scale; 1 disables it"
    )
    p.add_argument("--guidance-rescale", type=float, default=None,
                   help="0..1: pull the guided prediction back to the conditional one's scale (diffusers' "
                   "guidance_rescale); keeps high --guidance from breaking strokes (default: the model's)")
    p.add_argument(
        "--size", default=None, help="WIDTHxHEIGHT in pixels, e.g. 32x32 (multiples of the latent factor)"
    )
    p.add_argument("--seed", type=int, default=None, help="random seed (same seed → same image)")
    p.add_argument(
        "--num-images", type=int, default=1, help="images to make; more than one are saved as a grid"
    )
    p.add_argument("--few-step", action="store_true", help="use the distilled few-step student (LCM, no CFG)")
    p.add_argument("--scheduler", default=None,
                   help="override the scheduler: FlowMatchEulerDiscreteScheduler, "
                   "DDIMScheduler, LCMScheduler (or flow_match, ddim, lcm)")  # fmt: skip
    p.add_argument("--model", default=None,
                   help="pipeline folder or image model name (default: digits, the embedded model)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--attention-backend", default=None, help="attention backend (sdpa, naive)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads for torch (default 1: the embedded model is tiny, and extra threads on a busy "
        "machine make it slower, not faster)",
    )
    p.add_argument("-o", "--output", default="image.png", help="output PNG path")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=run)


def _parse_size(text: str | None) -> tuple[int | None, int | None]:
    from forwardpass.errors import ValidationError

    if text is None:
        return None, None
    parts = text.lower().split("x")
    try:
        if len(parts) == 1:
            return int(parts[0]), int(parts[0])
        if len(parts) == 2:
            return int(parts[0]), int(parts[1])
    except ValueError:
        pass
    raise ValidationError(f"--size {text!r} must look like WIDTHxHEIGHT, e.g. 32x32", param="size")


def run(args: argparse.Namespace) -> int:
    import time

    import torch

    from forwardpass.diffusion import DEFAULT_MODEL_DIR
    from forwardpass.diffusion.images import make_image_grid
    from forwardpass.diffusion.pipeline import ImagePipeline
    from forwardpass.errors import ValidationError

    if args.threads < 1:
        raise ValidationError(f"--threads must be >= 1, got {args.threads}", param="threads")
    torch.set_num_threads(args.threads)
    width, height = _parse_size(args.size)
    from forwardpass.commands._common import check_device

    device = check_device(args.device)
    from forwardpass.registry import resolve_model

    folder = resolve_model(args.model, kinds=("image",)) if args.model is not None else DEFAULT_MODEL_DIR
    pipe = ImagePipeline.from_pretrained(folder, few_step=args.few_step, num_threads=args.threads,
                                         scheduler=args.scheduler,
                                         attention_backend=args.attention_backend)  # fmt: skip
    pipe.to(device)
    start = time.perf_counter()
    images = pipe(
        args.prompt,
        negative_prompt=args.negative_prompt,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance,
        guidance_rescale=args.guidance_rescale,
        negative_mode=args.negative_mode,
        height=height,
        width=width,
        num_images_per_prompt=args.num_images,
        seed=args.seed,
        show_progress=not args.no_progress,
    ).images
    elapsed = time.perf_counter() - start
    if len(images) == 1:
        image = images[0]
    else:
        image = make_image_grid(images)  # as square as fits with no empty cell
    image.save(args.output)
    print(f"wrote {args.output} ({len(images)} image(s), {elapsed:.2f} s)")
    return 0
