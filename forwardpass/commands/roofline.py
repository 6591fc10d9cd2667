"""``forwardpass roofline``: which resource limits a model on an accelerator, per operation.

forwardpass roofline MODEL_DIR_OR_CONFIG_OR_PRESET --hardware h100 [--prefill 2048] [--context 4096]
    [--batch 1,8,64] [--weight-dtype bf16] [--kv-dtype bf16] [--json] [--plot roofline.png] [--measure]
forwardpass roofline attention --n 4096 --d 128 [--heads 32 --kv-heads 8] [--dtype fp16]
forwardpass roofline dit --latent 64x64 --patch 2 --width 1152 --depth 28 --text-len 120 --steps 20 --cfg
forwardpass roofline video --frames 16 --latent 60x104 --space-time full|factorized --batch 1,2,4 --cfg
forwardpass roofline hardware          # the spec table (add --hardware this-machine to measure)
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

SPECIAL = ("attention", "dit", "video", "hardware")


def _batches(text: str) -> list[int]:
    try:
        values = [int(x) for x in str(text).replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--batch takes comma-separated integers like 1,8,64, got {text!r}"
        ) from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"--batch takes positive integers like 1,8,64, got {text!r}")
    return values


def _gb(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--memory-budget takes GB as a number, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError("--memory-budget must be positive")
    return v * 1e9


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "roofline",
        help="bottleneck analysis: FLOPs, bytes and predicted latency per operation",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "target",
        help="a model directory, a config.json, a built-in shape (llama-3-8b, qwen3-0.6b, qwen3-30b-a3b, "
        "...), or one of: attention, dit, video, hardware",
    )
    p.add_argument(
        "--hardware", default="h100", help="a100, h100, h200, b200, l4, l40s, mi300x or this-machine"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--plot", metavar="PNG", default=None, help="write a roofline plot to this file")
    p.add_argument("--remeasure", action="store_true", help="re-run the this-machine microbenchmark")

    m = p.add_argument_group("model")
    m.add_argument("--prefill", type=int, default=None, metavar="P",
                   help="prompt tokens (default 2048, or the model's context length if shorter)")
    m.add_argument("--context", type=int, default=None, metavar="L",
                   help="decode context length (default 4096, or the model's context length if shorter)")
    m.add_argument("--batch", type=_batches, default=None, help="decode batch sizes, e.g. 1,8,64 (dit: one)")
    m.add_argument("--weight-dtype", default=None, help="fp32, bf16, fp16, fp8, int8, int4 (default bf16; "
                   "fp32 on this-machine)")  # fmt: skip
    m.add_argument("--act-dtype", default=None, help="activation dtype (default: follows weights)")
    m.add_argument("--kv-dtype", default=None, help="KV-cache dtype (default: the activation dtype)")
    m.add_argument("--attention", choices=("fused", "naive"), default="fused", help="attention kernel model")
    m.add_argument("--memory-budget", type=_gb, default=None, metavar="GB",
                   help="memory for weights + KV cache (default 90%% of the device)")  # fmt: skip
    m.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks: also print the communication per step and its "
                   "time")  # fmt: skip
    m.add_argument("--interconnect", default=None, help="for --tp: nvlink3/4/5, pcie4/5, ib-hdr/ndr, "
                   "infinity-fabric (default: the hardware's GPU-to-GPU link)")  # fmt: skip
    m.add_argument("--brief", action="store_true", help="omit the per-operation tables")
    m.add_argument("--measure", action="store_true",
                   help="also run the engine on this machine and print predicted vs measured")  # fmt: skip
    m.add_argument("--new-tokens", type=int, default=32, help="--measure: tokens generated per request")
    m.add_argument("--prompt-len", type=int, default=128, help="--measure: prompt tokens")
    m.add_argument("--runs", type=int, default=3, help="--measure: repetitions (median)")

    a = p.add_argument_group("attention (forwardpass roofline attention ...)")
    a.add_argument("--n", type=int, default=4096, help="sequence length N")
    a.add_argument("--d", type=int, default=128, help="head dimension d")
    a.add_argument("--heads", type=int, default=None, help="query heads (attention: 1; dit: 16)")
    a.add_argument("--kv-heads", type=int, default=None, help="KV heads (default: = heads)")
    a.add_argument("--dtype", default="fp16", help="attention element dtype (fp32, bf16, fp16, fp8)")
    a.add_argument("--causal", action="store_true", help="causal mask (fused kernel skips masked tiles)")
    a.add_argument(
        "--decode-context", type=int, default=None, help="keys for the one-query decode row (default N)"
    )

    d = p.add_argument_group("diffusion (forwardpass roofline dit ...)")
    d.add_argument("--latent", default="64x64", help="latent height x width, e.g. 64x64")
    d.add_argument("--channels", type=int, default=4, help="latent channels")
    d.add_argument("--patch", type=int, default=2, help="patch size")
    d.add_argument("--width", type=int, default=1152, help="hidden width")
    d.add_argument("--depth", type=int, default=28, help="number of DiT blocks")
    d.add_argument("--text-len", type=int, default=120, help="text tokens for cross-attention (0 = none)")
    d.add_argument("--mlp-ratio", type=float, default=4.0)
    d.add_argument("--steps", type=int, default=20, help="denoising steps")
    d.add_argument("--cfg", action="store_true", help="classifier-free guidance (2 passes per step)")
    v = p.add_argument_group("video (forwardpass roofline video ...; also the diffusion flags above)")
    v.add_argument("--frames", type=int, default=16, help="latent frames in the clip")
    v.add_argument("--patch-t", type=int, default=1, help="temporal patch size")
    v.add_argument("--space-time", choices=("full", "factorized"), default="full",
                   help="full spatio-temporal attention, or space then time (factorised)")  # fmt: skip
    v.add_argument("--frames-sweep", type=_batches, default=[1, 4, 8, 16, 32, 64],
                   help="clip lengths for the attention-share table, e.g. 1,8,32")  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    target = args.target
    if target == "attention":
        return _run_attention(args)
    if target == "video":
        from forwardpass.analysis.video_report import run_video

        return run_video(args)
    if target == "dit":
        return _run_dit(args)
    if target == "hardware":
        return _run_hardware(args)
    return _run_model(args)


def _emit_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")


def _run_model(args: argparse.Namespace) -> int:
    from forwardpass.analysis.roofline import analyze, resolve_spec
    from forwardpass.commands._common import progress
    from forwardpass.errors import ConfigError

    max_pos = getattr(resolve_spec(args.target), "max_position_embeddings", None)
    for flag, default in (("prefill", 2048), ("context", 4096)):
        value = getattr(args, flag)
        if value is None:
            setattr(args, flag, min(default, max_pos) if max_pos else default)
        elif max_pos and value > max_pos:
            raise ConfigError(f"--{flag} {value} is longer than the model's context ({max_pos} tokens, "
                              "max_position_embeddings)", param=flag)
    with progress("reading the model and the hardware (this-machine: measuring it once, then cached)"):
        report = analyze(
            args.target,
            hardware=args.hardware,
            prefill_tokens=args.prefill,
            context=args.context,
            batches=args.batch or (1, 8, 64),
            weight_dtype=args.weight_dtype,
            act_dtype=args.act_dtype,
            kv_dtype=args.kv_dtype,
            attention=args.attention,
            memory_budget=args.memory_budget,
            remeasure=args.remeasure,
        )
    oh = oh_rows = None
    if report.hardware.name == "this-machine":  # the third bound: measured here, so only for this machine
        from forwardpass.analysis.overhead import overhead_rows, this_machine_overhead

        with progress("measuring this machine's per-step overhead"):
            oh = this_machine_overhead(remeasure=args.remeasure)
        oh_rows = overhead_rows(report, oh)
    comm = None
    if args.tp > 1:  # what the ranks exchange per step (analysis/parallel.py)
        from forwardpass.analysis.parallel import communication_rows

        act = args.act_dtype or report.hardware.default_dtype
        comm = communication_rows(resolve_spec(args.target), args.tp, args.prefill, args.batch or (1, 8, 64),
                                  dtype_bytes=4 if act in ("fp32", "float32") else 2,
                                  interconnect=args.interconnect, hardware=report.hardware)
    measured = None
    if args.measure:
        from forwardpass.explain.measure import measure

        with progress(f"running the engine on {args.target} (--measure: {args.runs} runs per batch size)"):
            measured = measure(
                args.target,
                batches=args.batch or (1,),
                prompt_tokens=args.prompt_len,
                new_tokens=args.new_tokens,
                runs=args.runs,
                weight_dtype=args.weight_dtype,
                hardware="this-machine",
            )
    if args.plot:
        from forwardpass.analysis.overhead import measured_points
        from forwardpass.analysis.plot import plot_report

        plot_report(report, args.plot, measured_points(measured) if measured is not None else None)
    if args.json:
        out = report.to_dict()
        if oh is not None:
            out["overhead"] = {"measured": oh.to_dict(), "stages": oh_rows}
        if measured is not None:
            out["measure"] = measured.to_dict()
        if args.plot:
            out["plot"] = args.plot
        if comm is not None:
            out["communication"] = comm
        _emit_json(out)
        return 0
    from forwardpass.analysis.report import console, render_measure, render_overhead, render_roofline

    c = console()
    render_roofline(report, show_ops=not args.brief, out=c)
    if oh_rows is not None:
        c.print()
        render_overhead(oh_rows, oh, out=c)
    if measured is not None:
        c.print()
        render_measure(measured.rows, out=c, settings=measured.settings)
    if comm is not None:
        from forwardpass.analysis.parallel import render_communication

        c.print()
        for line in render_communication(comm):
            c.print(line, highlight=False)
    if args.plot:
        c.print(f"\nroofline plot written to {args.plot}")
    return 0


def _run_attention(args: argparse.Namespace) -> int:
    from forwardpass.analysis.attention import compare_kernels
    from forwardpass.analysis.hardware import get_hardware
    from forwardpass.commands._common import progress

    with progress(f"reading hardware {args.hardware}"):
        hw = get_hardware(args.hardware, remeasure=args.remeasure)
    rows = compare_kernels(
        args.n,
        args.d,
        heads=args.heads or 1,
        kv_heads=args.kv_heads,
        dtype=args.dtype,
        context=args.decode_context,
        causal=args.causal,
        hardware=hw,
    )
    if args.plot:
        from forwardpass.analysis.plot import Point, plot_roofline

        pts = [Point(r.impl, r.intensity, r.flops / r.time_s, "attention", r.impl) for r in rows]
        plot_roofline(hw, pts, args.plot, dtype=rows[0].dtype,
                      title=f"Attention N={args.n}, d={args.d} on {hw.label}")  # fmt: skip
    if args.json:
        _emit_json({"hardware": hw.to_dict(rows[0].dtype), "kernels": [r.to_dict() for r in rows]})
        return 0
    from forwardpass.analysis.report import console, render_attention

    c = console()
    render_attention(rows, hw, out=c)
    if args.plot:
        c.print(f"\nroofline plot written to {args.plot}")
    return 0


def _run_dit(args: argparse.Namespace) -> int:
    from forwardpass.analysis.diffusion import dit_cost, parse_size
    from forwardpass.errors import ConfigError

    h, w = parse_size(args.latent)
    if args.batch and len(args.batch) > 1:
        raise ConfigError("roofline dit takes one --batch value", param="batch")
    rep = dit_cost(
        h,
        w,
        args.channels,
        args.patch,
        args.width,
        args.depth,
        args.heads or 16,
        args.text_len,
        args.mlp_ratio,
        args.steps,
        args.cfg,
        batch=(args.batch or [1])[0],
        hardware=args.hardware,
        weight_dtype=args.weight_dtype,
        act_dtype=args.act_dtype,
    )
    if args.plot:
        from forwardpass.analysis.plot import plot_roofline, points_from_ops

        plot_roofline(rep.hardware, points_from_ops(rep.ops), args.plot, dtype=rep.act_dtype,
                      title=f"DiT denoising step on {rep.hardware.label}")  # fmt: skip
    if args.json:
        _emit_json(rep.to_dict())
        return 0
    from forwardpass.analysis.report import console, render_dit

    c = console()
    render_dit(rep, show_ops=not args.brief, out=c)
    if args.plot:
        c.print(f"\nroofline plot written to {args.plot}")
    return 0


def _run_hardware(args: argparse.Namespace) -> int:
    from forwardpass.analysis.hardware import SPECS, THIS_MACHINE, get_hardware
    from forwardpass.commands._common import progress

    rows = list(SPECS.values())
    if str(args.hardware).lower() in (THIS_MACHINE, "cpu", "local", "this") or args.remeasure:
        with progress("measuring this machine (once, then cached)"):
            rows.append(get_hardware(THIS_MACHINE, remeasure=args.remeasure))
    if args.json:
        _emit_json([h.to_dict() for h in rows])
        return 0
    from rich.table import Table

    from forwardpass.analysis.report import console

    t = Table(title="Accelerators (dense peaks)", title_justify="left", show_edge=False)
    for name in (
        "name",
        "device",
        "bf16 TFLOP/s",
        "fp8 TFLOP/s",
        "fp32 TFLOP/s",
        "GB/s",
        "GB",
        "ridge (bf16)",
    ):
        t.add_column(name, justify="left" if name in ("name", "device") else "right")
    for h in rows:
        fp8 = h.flops.get("fp8")
        t.add_row(
            h.name, h.label, f"{h.peak('bf16') / 1e12:.4g}", f"{fp8 / 1e12:.4g}" if fp8 else "-",
            f"{h.flops.get('fp32', h.vector_flops) / 1e12:.4g}", f"{h.bandwidth / 1e9:.4g}",
            f"{h.capacity / 1e9:.4g}", f"{h.ridge('bf16'):.3g}",
        )  # fmt: skip
    console().print(t)
    return 0
