"""Terminal rendering (rich tables) of roofline, attention-kernel and DiT reports."""

from __future__ import annotations

import math
from typing import Any

from forwardpass.op_cost import OpCost


def _si(x: float, unit: str, *, digits: int = 3) -> str:
    if x is None:
        return "-"
    if not math.isfinite(x):
        return "∞"
    if x == 0:
        return f"0 {unit}"
    for factor, prefix in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.{digits}g} {prefix}{unit}"
    return f"{x:.{digits}g} {unit}"


def fmt_flops(x: float) -> str:
    return _si(x, "FLOP")


def fmt_bytes(x: float) -> str:
    return _si(x, "B")


def fmt_rate(x: float, unit: str) -> str:
    return _si(x, unit)


def fmt_time(s: float) -> str:
    if s is None or not math.isfinite(s):
        return "-"
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    if s >= 1e-6:
        return f"{s * 1e6:.3g} µs"
    return f"{s * 1e9:.3g} ns"


def fmt_ai(x: float) -> str:
    if x is None or not math.isfinite(x):
        return "∞"
    return f"{x:.3g}" if x < 1000 else f"{x:,.0f}"


def _bound(b: str) -> str:
    colour = {"memory": "red", "overhead": "yellow"}.get(b, "green")
    return f"[{colour}]{b}[/{colour}]"


def console() -> Any:
    from rich.console import Console

    c = Console()
    if not c.is_terminal:
        c = Console(width=140)
    return c


def ops_table(title: str, ops: list[OpCost]) -> Any:
    from rich.table import Table

    total = sum(o.time_s for o in ops) or 1.0
    t = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    for name, just in (
        ("op", "left"), ("×", "right"), ("FLOPs", "right"), ("weights", "right"), ("activations", "right"),
        ("KV r/w", "right"), ("FLOP/B", "right"), ("bound", "left"), ("time", "right"), ("%", "right"),
    ):  # fmt: skip
        t.add_column(name, justify=just)  # type: ignore[arg-type]
    for o in ops:
        kv = fmt_bytes(o.kv_read_bytes + o.kv_write_bytes) if (o.kv_read_bytes or o.kv_write_bytes) else ""
        t.add_row(
            o.name, str(o.count), fmt_flops(o.flops), fmt_bytes(o.weight_bytes) if o.weight_bytes else "",
            fmt_bytes(o.act_bytes) if o.act_bytes else "", kv, fmt_ai(o.intensity), _bound(o.bound),
            fmt_time(o.time_s), f"{100 * o.time_s / total:.1f}",
        )  # fmt: skip
    return t


def render_roofline(report: Any, *, show_ops: bool = True, out: Any = None) -> None:
    """Print a :class:`~forwardpass.analysis.roofline.RooflineReport`."""
    from rich.table import Table

    c = out or console()
    hw, s = report.hardware, report.shape
    moe = ""
    if s.moe is not None and s.moe.layer_ids:
        moe = (f" ({s.active_params / 1e9:.3g} B active: {s.moe.experts_per_tok} of {s.moe.num_experts} "
               "experts)")
    c.print(f"[bold]{report.model}[/bold]  {s.architecture}  {s.params / 1e9:.3g} B params{moe}")
    c.print(
        f"[bold]{hw.label}[/bold]: {hw.peak(report.act_dtype) / 1e12:.4g} TFLOP/s "
        f"{hw.compute_dtype(report.act_dtype)}, {hw.bandwidth / 1e9:.4g} GB/s, {hw.capacity / 1e9:.4g} GB → "
        f"ridge {report.ridge:.3g} FLOP/byte" + (f"  [dim]({hw.source})[/dim]" if hw.measured_at else "")
    )
    c.print(
        f"weights {report.weight_dtype} ({fmt_bytes(report.weight_bytes)}), activations {report.act_dtype}, "
        f"KV {report.kv_dtype}, attention {report.attention}"
    )
    p = report.prefill
    c.print()
    c.print(
        f"[bold]Prefill[/bold] {p.tokens} tokens: TTFT {fmt_time(p.time_s)}, {fmt_flops(p.total.flops)}, "
        f"{fmt_bytes(p.total.bytes)}, {fmt_ai(p.total.intensity)} FLOP/B → {_bound(p.bound)}-bound "
        f"({p.tokens_per_s:,.0f} tok/s)"
    )
    t = Table(
        title=f"Decode step at context {report.decode[0].context}", title_justify="left", show_edge=False
    )
    for name in ("batch", "FLOPs", "bytes", "of which KV", "FLOP/B", "TPOT", "tokens/s", "bound"):
        t.add_column(name, justify="left" if name == "bound" else "right")
    for d in report.decode:
        t.add_row(
            str(d.batch), fmt_flops(d.total.flops), fmt_bytes(d.total.bytes),
            fmt_bytes(d.total.kv_read_bytes), fmt_ai(d.total.intensity), fmt_time(d.time_s),
            f"{d.tokens_per_s:,.1f}", _bound(d.bound),
        )  # fmt: skip
    c.print(t)
    cross = report.crossover_batch
    step_cross = report.step_crossover_batch
    state = s.state_bytes_per_sequence(4)
    c.print(
        f"KV cache: {fmt_bytes(report.kv_bytes_per_token)} per token"
        + (f" + state {fmt_bytes(state)} per request (fp32, constant in its length)" if state else "")
        + "; largest batch at context "
        f"{report.decode[0].context} in {fmt_bytes(report.memory_budget)}: [bold]{report.max_batch}[/bold]"
    )
    c.print(
        f"Decode turns compute-bound at batch [bold]{cross if cross else 'never'}[/bold] in the linear "
        f"layers (estimate ridge × bytes/weight / 2{' × experts/active' if s.is_moe else ''} = "
        f"{report.crossover_estimate:.0f})"
    )
    c.print(
        f"  whole decode step at context {report.decode[0].context}: "
        + (
            f"compute-bound from batch {step_cross}"
            if step_cross
            else "never compute-bound (KV reads grow with batch)"
        )
    )
    if show_ops:
        c.print()
        c.print(ops_table(f"Prefill ops ({p.tokens} tokens, all layers)", p.ops))
        d0 = report.decode[0]
        c.print()
        c.print(ops_table(f"Decode ops (batch {d0.batch}, context {d0.context}, all layers)", d0.ops))


def render_attention(rows: list[Any], hw: Any = None, out: Any = None) -> None:
    from rich.table import Table

    c = out or console()
    r0 = rows[0]
    title = f"Attention kernels: N={r0.n_q}, d={r0.d}, heads={r0.heads}, kv_heads={r0.kv_heads}, {r0.dtype}"
    if hw is not None:
        title += f" on {hw.label} (ridge {hw.ridge(r0.dtype):.3g})"
    t = Table(title=title, title_justify="left", show_edge=False)
    for name in ("kernel", "queries×keys", "FLOPs", "S (=P) size", "S/P traffic", "Q,K,V,O", "bytes",
                 "FLOP/B", "bound", "time"):  # fmt: skip
        t.add_column(name, justify="left" if name in ("kernel", "bound") else "right")
    for r in rows:
        t.add_row(
            r.impl, f"{r.n_q}×{r.n_k}", fmt_flops(r.flops),
            f"{r.s_bytes / 2**20:.4g} MiB" if r.s_bytes else "-",
            fmt_bytes(r.sp_traffic_bytes) if r.sp_traffic_bytes else "-",
            fmt_bytes(r.qkv_read_bytes + r.o_write_bytes), fmt_bytes(r.bytes), fmt_ai(r.intensity),
            _bound(r.bound) if r.bound else "", fmt_time(r.time_s) if r.bound else "",
        )  # fmt: skip
    c.print(t)
    _render_flash_tiles(r0, c)


def _render_flash_tiles(r0: Any, c: Any) -> None:
    """Tile sizes and per-tile working set of this package's FlashAttention (attention/flash.py)."""
    from forwardpass.attention.flash import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, tile_footprint_bytes

    fp32 = tile_footprint_bytes(r0.d, elem=4)
    c.print(
        f"flash (attention/flash.py): tiles {DEFAULT_BLOCK_Q} queries × {DEFAULT_BLOCK_K} keys; working set "
        f"per (head, tile) step {fmt_bytes(fp32)} in fp32 (q, K, V and score tiles, running max/sum, "
        f"accumulator) — what must stay in SRAM / cache, against {r0.s_bytes / 2**20:.4g} MiB for the full S "
        "of one head"
    )


def render_dit(rep: Any, *, show_ops: bool = True, out: Any = None) -> None:
    c = out or console()
    hw = rep.hardware
    h, w, ch = rep.latent
    c.print(
        f"[bold]DiT[/bold] latent {h}×{w}×{ch}, patch {rep.patch_size} → {rep.tokens} tokens, width "
        f"{rep.hidden}, depth {rep.depth}, heads {rep.heads}, text {rep.text_len}, mlp ×{rep.mlp_ratio:g}: "
        f"{rep.params / 1e6:.4g} M params"
    )
    c.print(
        f"[bold]{hw.label}[/bold]: {hw.peak(rep.act_dtype) / 1e12:.4g} TFLOP/s, {hw.bandwidth / 1e9:.4g} "
        f"GB/s, ridge {hw.ridge(rep.act_dtype):.3g}; weights {rep.weight_dtype}, activations {rep.act_dtype}"
    )
    s = rep.step
    c.print(
        f"per step ({rep.passes_per_step} pass{'es' if rep.passes_per_step > 1 else ''}"
        f"{', CFG' if rep.cfg else ''}, batch {rep.batch}): {fmt_flops(s.flops)}, {fmt_bytes(s.bytes)}, "
        f"{fmt_ai(s.intensity)} FLOP/B → {_bound(s.bound)}-bound, {fmt_time(s.time_s)}"
    )
    c.print(
        f"[bold]{rep.steps} steps[/bold]: {fmt_flops(rep.total_flops)}, {fmt_bytes(rep.total_bytes)}, "
        f"{fmt_time(rep.total_time_s)}"
    )
    if show_ops:
        c.print()
        c.print(ops_table("Ops of one step (all blocks)", rep.ops))


def render_overhead(rows: list[dict[str, Any]], overhead: Any, out: Any = None) -> None:
    """The third bound: each stage with the measured per-step and per-layer overhead added."""
    from rich.table import Table

    c = out or console()
    t = Table(title="With the measured overhead (the third bound)", title_justify="left", show_edge=False,
              caption=f"overhead {fmt_time(overhead.per_step_s)} per step + {fmt_time(overhead.per_layer_s)} "
                      f"per layer ({overhead.method})", caption_justify="left")
    for name in ("stage", "batch", "roofline", "overhead", "predicted", "tokens/s", "bound"):
        t.add_column(name, justify="left" if name in ("stage", "bound") else "right")
    for r in rows:
        t.add_row(r["stage"], str(r["batch"]), fmt_time(r["roofline_s"]), fmt_time(r["overhead_s"]),
                  fmt_time(r["time_s"]), f"{r['tokens_per_s']:,.1f}", _bound(r["bound"]))
    c.print(t)


def render_measure(rows: list[dict[str, Any]], out: Any = None,
                   settings: dict[str, Any] | None = None) -> None:
    from rich.table import Table

    c = out or console()
    caption = "ratio = measured / predicted: the fraction of the prediction the engine reaches"
    if settings:
        oh = settings.get("overhead")
        caption += (
            f"\nsettings: {settings['hardware']}; batches {settings['batches']}, prompt "
            f"{settings['prompt_tokens']} tokens, {settings['new_tokens']} new tokens, median of "
            f"{settings['runs']} runs, weights {settings['weight_dtype']}; engine {settings['engine']}"
            + (f"\npredicted = roofline + overhead {fmt_time(settings['overhead_per_step_s'])} per step "
               f"({fmt_time(oh['per_step_s'])} + {fmt_time(oh['per_layer_s'])} per layer, {oh['method']})"
               if oh else "\npredicted = roofline only (no overhead)")
        )
    t = Table(title="Predicted vs measured (this machine)", title_justify="left", show_edge=False,
              caption=caption, caption_justify="left")
    for name in ("batch", "metric", "roofline only", "predicted", "measured", "measured / predicted",
                 "bound"):
        t.add_column(name, justify="left" if name in ("metric", "bound") else "right")
    for r in rows:
        ratio = r["measured"] / r["predicted"] if r["predicted"] else float("nan")
        ro = r.get("roofline_only")
        t.add_row(
            str(r["batch"]), r["metric"], f"{ro:,.2f}" if ro else "-", f"{r['predicted']:,.2f}",
            f"{r['measured']:,.2f}", f"{ratio:.2f}", _bound(r.get("bound", "-")),
        )
    c.print(t)
