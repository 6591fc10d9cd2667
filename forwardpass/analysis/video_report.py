"""Rendering ``forwardpass roofline video``: one step's cost, attention share vs frames, and why batch 1."""

from __future__ import annotations

from typing import Any

from forwardpass.analysis.report import _bound, console, fmt_ai, fmt_flops, fmt_time, ops_table


def render_video(rep: Any, frames_rows: list[dict[str, Any]], batch_rows: list[dict[str, Any]], *,
                 show_ops: bool = True, out: Any = None) -> None:  # fmt: skip
    from rich.table import Table

    c = out or console()
    hw, (h, w, ch), (pt, p) = rep.hardware, rep.latent, rep.patch
    s = rep.step
    c.print(
        f"[bold]Video DiT[/bold] {rep.frames} frames × latent {h}×{w}×{ch}, patch {pt}×{p}×{p} → "
        f"{rep.tokens} tokens per clip, width {rep.hidden}, depth {rep.depth}, heads {rep.heads}, "
        f"{rep.attention} attention"
    )
    c.print(f"[bold]{hw.label}[/bold]: ridge {hw.ridge(rep.act_dtype):.3g} FLOP/B ({rep.act_dtype})")
    c.print(f"per step ({'2 passes, CFG' if rep.cfg else '1 pass'}, batch {rep.batch}): "
            f"{fmt_flops(s.flops)}, {fmt_ai(s.intensity)} FLOP/B → {_bound(s.bound)}-bound, "
            f"{fmt_time(s.time_s)}; attention {100 * rep.attention_share:.0f}% of FLOPs; {rep.steps} steps: "
            f"{fmt_time(rep.total_time_s)}")  # fmt: skip
    t = Table(title="Attention share vs clip length", title_justify="left", show_edge=False,
              caption="full: one attention over all "
              "frames' tokens, cost ∝ (T·S)²; factorized: space then time, T·S² + S·T²",
              caption_justify="left")  # fmt: skip
    for name in (
        "frames",
        "tokens",
        "full: attention",
        "full: step",
        "factorized: attention",
        "factorized: step",
    ):
        t.add_column(name, justify="right")
    for r in frames_rows:
        t.add_row(str(r["frames"]), f"{r['tokens']:,}", f"{100 * r['full']['attention_share']:.0f}%",
                  fmt_time(r["full"]["step_time_s"]), f"{100 * r['factorized']['attention_share']:.0f}%",
                  fmt_time(r["factorized"]["step_time_s"]))  # fmt: skip
    c.print(t)
    t = Table(title="Why batch 1", title_justify="left", show_edge=False,
              caption="already compute-bound at batch 1: a batch of b clips takes b× as long, so clips/s "
              "stays flat while each clip waits b× longer", caption_justify="left")  # fmt: skip
    for name in ("batch", "FLOP/B", "bound", "latency per clip", "clips/s"):
        t.add_column(name, justify="right")
    for r in batch_rows:
        t.add_row(str(r["batch"]), fmt_ai(r["intensity"] or float("inf")), _bound(r["bound"]),
                  fmt_time(r["latency_s"]), f"{r['clips_per_s']:.4g}")  # fmt: skip
    c.print(t)
    if show_ops:
        c.print(ops_table("Ops of one step (all blocks)", rep.ops))


def run_video(args: Any) -> int:
    """``forwardpass roofline video``: the flags of the ``dit`` group plus --frames,
    --patch-t, --space-time."""
    import json
    import sys

    from forwardpass.analysis.diffusion import parse_size
    from forwardpass.analysis.video import batch_sweep, frames_sweep, video_dit_cost

    h, w = parse_size(args.latent)
    shape = {"latent_h": h, "latent_w": w, "channels": args.channels, "patch": args.patch,
             "patch_t": args.patch_t, "hidden": args.width, "depth": args.depth, "heads": args.heads or 16,
             "text_len": args.text_len, "mlp_ratio": args.mlp_ratio, "steps": args.steps, "cfg": args.cfg,
             "hardware": args.hardware,
             "weight_dtype": args.weight_dtype, "act_dtype": args.act_dtype}  # fmt: skip
    rep = video_dit_cost(args.frames, attention=args.space_time, **shape)
    frames_rows = frames_sweep([f for f in args.frames_sweep if f % args.patch_t == 0], **shape)
    batch_rows = batch_sweep(
        args.batch or [1, 2, 4, 8], frames=args.frames, attention=args.space_time, **shape
    )
    if args.json:
        json.dump(
            {**rep.to_dict(), "frames_sweep": frames_rows, "batch_sweep": batch_rows}, sys.stdout, indent=2
        )
        sys.stdout.write("\n")
        return 0
    render_video(rep, frames_rows, batch_rows, show_ops=not args.brief)
    return 0
