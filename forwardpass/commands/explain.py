"""``forwardpass explain PROMPT``: one real request, step by step (terminal, ``--html``, ``--json``)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from forwardpass.commands._common import add_model_args, speculative_config_arg

    p = sub.add_parser("explain", help="run one request and show what the engine did, step by step")
    p.add_argument("prompt", help="the prompt text")
    add_model_args(p)  # --model, --revision, --dtype, --max-model-len, --device
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: generation_config)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0: reproducible, verifiable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--layer", type=int, default=None, help="layer of the attention heatmap (default: last)")
    p.add_argument("--head", type=int, default=0, help="query head of the attention heatmap")
    p.add_argument("--hardware", default="this-machine", help="roofline hardware (default: measured)")
    p.add_argument("--no-overhead", action="store_true", help="leave the measured overhead out")
    p.add_argument("--html", metavar="FILE", default=None, help="also write a self-contained HTML report")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the terminal view")
    p.add_argument("--batching", nargs="?", const="1,4,16,32", default=None, metavar="SIZES",
                   help="also decode the prompt beside copies of itself at these batch sizes (default "
                        "1,4,16,32): FLOP/s and bytes/s against the roofs as the batch grows")
    p.add_argument("--speculative-config", type=speculative_config_arg, default=None, metavar="JSON",
                   help="speculative decoding (as for generate): each step's proposed, accepted and rejected "
                        "drafts are shown")
    p.set_defaults(func=run)
    register_image(sub)


def run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from forwardpass.commands._common import resolve_model
    from forwardpass.explain import explain

    model = resolve_model(args.model, args.revision)  # forwardpass/registry.py; None: the embedded model
    ex = explain(
        args.prompt, model=model, max_tokens=args.max_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed, ignore_eos=args.ignore_eos,
        layer=args.layer, head=args.head, hardware=args.hardware,
        overhead=None if args.no_overhead else "this-machine", dtype=args.dtype, device=args.device,
        speculative_config=args.speculative_config, batch_sizes=_sizes(args.batching),
    )
    if args.html:
        from forwardpass.explain.html import render_html

        Path(args.html).write_text(render_html(ex), encoding="utf-8")
    if args.json:
        print(json.dumps(ex))
    else:
        from forwardpass.explain.terminal import render

        render(ex)
        if args.html:
            print(f"report written to {args.html}")
    return 0


def _sizes(text: str | None) -> tuple[int, ...]:
    """``--batching 1,4,16`` as batch sizes (an empty tuple when the flag is absent)."""
    from forwardpass.errors import ValidationError

    if text is None:
        return ()
    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise ValidationError(f"--batching takes batch sizes like 1,4,16, got {text!r}", param="--batching")
    return sizes


def register_image(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("explain-image",
                       help="teacher vs few-step student: the latent resolving, step by step")
    p.add_argument("prompt", help="what to draw, e.g. 'a handwritten 7'")
    p.add_argument("--model", default=None, help="pipeline folder (default: the embedded digits model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="teacher steps (default: the model's)")
    p.add_argument("--guidance", type=float, default=None, help="teacher guidance (default: the model's)")
    p.add_argument("--student-steps", type=int, default=None, help="student steps (default: the model's)")
    p.add_argument("--frames", type=int, default=8, help="steps decoded into the strip")
    p.add_argument("--hardware", default="this-machine")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (as forwardpass image: a tiny model gains nothing from more)")
    p.add_argument("-o", "--output", default=None, help="write the strip as a PNG (a row per run)")
    p.add_argument("--html", metavar="FILE", default=None, help="write a self-contained HTML report")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_image)


def run_image(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    import torch

    from forwardpass.explain.image import explain_image, render_image_html, strip_image, to_json

    torch.set_num_threads(max(1, args.threads))  # applied by the command already (forwardpass/threads.py)
    ex = explain_image(args.prompt, model=args.model, seed=args.seed, steps=args.steps,
                       guidance=args.guidance, student_steps=args.student_steps, frames=args.frames,
                       hardware=args.hardware)
    if args.output:
        strip_image(ex).save(args.output)
    if args.html:
        Path(args.html).write_text(render_image_html(ex), encoding="utf-8")
    if args.json:
        print(json.dumps(to_json(ex)))
        return 0
    from rich.console import Console
    from rich.table import Table

    from forwardpass.analysis.report import fmt_flops, fmt_time

    con = Console()
    for r in ex["runs"]:
        t = Table(title=f"{r['name']}: {r['steps']} steps of {r['scheduler']}, guidance {r['guidance']} → "
                        f"{r['forward_passes']} denoiser passes ({r['passes_per_step']} per step)")
        for col in ("step", "t", "passes so far", "time", "FLOPs", "predicted", "ratio", "regime"):
            t.add_column(col)
        for s in r["per_step"]:
            t.add_row(str(s["step"]), f"{s['t']:.1f}", str(s["passes_total"]), fmt_time(s["time_s"]),
                      fmt_flops(s["flops"]), fmt_time(s["predicted_s"]), f"{s['ratio']:.1f}x", s["regime"])
        con.print(t)
        for cause in sorted({s["cause_text"] for s in r["per_step"] if s.get("cause_text")}):
            con.print(f"overhead-bound steps ({r['name']}): {cause}")
    if args.output:
        con.print(f"strip written to {args.output} (rows: {', '.join(r['name'] for r in ex['runs'])})")
    return 0
