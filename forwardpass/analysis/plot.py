"""Roofline plots (matplotlib, Agg canvas: works headless and never touches the pyplot backend)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forwardpass.analysis.hardware import Hardware
from forwardpass.op_cost import OpCost

STAGE_COLOURS = {
    "prefill": "tab:blue",
    "decode": "tab:orange",
    "denoise": "tab:green",
    "attention": "tab:purple",
    "predicted": "tab:gray",  # --measure: a stage as predicted (roofline + overhead) ...
    "measured": "tab:red",  # ... and as measured
}
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]


@dataclass
class Point:
    label: str
    intensity: float  # FLOP/byte
    flops_per_s: float  # attained (predicted) FLOP/s
    stage: str  # colour group
    series: str = ""  # marker group within a stage (e.g. "decode b=8")
    annotate: bool = True


def points_from_ops(ops: Iterable[OpCost], *, annotate_batches: set[int] | None = None) -> list[Point]:
    """One point per op with finite, positive intensity (fused softmax moves no bytes: no point)."""
    out = []
    for op in ops:
        ai = op.intensity
        if op.flops <= 0 or not math.isfinite(ai) or op.time_s <= 0:
            continue
        series = op.stage if op.stage != "decode" else f"decode b={op.batch}"
        ann = op.stage != "decode" or annotate_batches is None or op.batch in annotate_batches
        out.append(Point(op.name, ai, op.flops / op.time_s, op.stage, series, ann))
    return out


def plot_roofline(
    hw: Hardware,
    points: list[Point],
    path: str | Path | None = None,
    *,
    dtype: str = "bf16",
    title: str | None = None,
) -> Any:
    """Draw both roofs (matrix peak in ``dtype`` and the FP32 vector rate), the memory roof, the ridge and
    the points; write a PNG to ``path`` when given. Returns the matplotlib ``Figure`` (Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    peak, bw = hw.peak(dtype), hw.bandwidth
    ridge = peak / bw
    xs = [p.intensity for p in points] + [ridge, hw.vector_ridge]
    x_lo = 10 ** math.floor(math.log10(max(min(xs), 1e-3)) - 0.5)
    x_hi = 10 ** math.ceil(math.log10(max(xs)) + 0.5)

    fig = Figure(figsize=(9, 6), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.set_xscale("log")
    ax.set_yscale("log")

    def roof(top: float, n: int = 200) -> tuple[list[float], list[float]]:
        x = [x_lo * (x_hi / x_lo) ** (i / (n - 1)) for i in range(n)]
        return x, [min(top, bw * v) for v in x]

    x, y = roof(peak)
    ax.plot(x, y, color="black", lw=2, label=f"roof: {peak / 1e12:.4g} TFLOP/s {hw.compute_dtype(dtype)}, "
            f"{bw / 1e9:.4g} GB/s")  # fmt: skip
    if hw.vector_flops and abs(hw.vector_flops - peak) / peak > 1e-6:
        x, y = roof(hw.vector_flops)
        ax.plot(
            x,
            y,
            color="grey",
            lw=1.2,
            ls="--",
            label=f"vector roof: {hw.vector_flops / 1e12:.4g} TFLOP/s fp32",
        )
    ax.axvline(ridge, color="tab:red", ls=":", lw=1.2, label=f"ridge {ridge:.3g} FLOP/byte")

    series_markers: dict[str, str] = {}
    for p in points:
        if p.series not in series_markers:
            series_markers[p.series] = MARKERS[len(series_markers) % len(MARKERS)]
    seen: set[str] = set()
    for p in points:
        colour = STAGE_COLOURS.get(p.stage, "tab:gray")
        label = p.series if p.series not in seen else None
        seen.add(p.series)
        ax.scatter(
            [p.intensity],
            [p.flops_per_s],
            color=colour,
            marker=series_markers[p.series],
            s=28,
            zorder=3,
            label=label,
            edgecolors="white",
            linewidths=0.4,
        )
    # one label per cluster of coinciding points (same series, within ~12% in intensity)
    clusters: dict[tuple[str, int], list[Point]] = {}
    for p in points:
        if p.annotate:
            clusters.setdefault((p.series, round(math.log10(p.intensity) * 20)), []).append(p)
    labels = []
    for group in sorted(clusters.values(), key=lambda g: g[0].intensity):
        names = list(dict.fromkeys(p.label for p in group))
        text = ", ".join(names[:3]) + (f" +{len(names) - 3}" if len(names) > 3 else "")
        labels.append((text, group[0]))

    ys = [p.flops_per_s for p in points] + [bw * x_lo, peak]
    ys = [p.flops_per_s for p in points] + [bw * x_lo, peak]
    ax.set_xlim(x_lo, x_hi)
    ax.set_ylim(10 ** math.floor(math.log10(max(min(ys), 1.0))), peak * 3)
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("attainable FLOP/s")
    ax.set_title(title or f"Roofline: {hw.label}")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    _place_labels(fig, ax, labels, points)  # after the layout: labels are placed in final display coordinates
    if path is not None:
        fig.savefig(str(path), format="png")
    return fig


def plot_report(report: Any, path: str | Path | None = None, extra: list[Point] | None = None) -> Any:
    """Roofline of a :class:`~forwardpass.analysis.roofline.RooflineReport`: prefill ops and each decode
    batch's ops (labels on the smallest batch only), plus ``extra`` points (``--measure``: each stage
    as predicted with overhead and as measured)."""
    first = min(d.batch for d in report.decode)
    pts = points_from_ops(report.ops, annotate_batches={first}) + list(extra or [])
    title = (
        f"{report.model} on {report.hardware.label} — weights {report.weight_dtype}, act {report.act_dtype}, "
        f"prefill {report.prefill.tokens}, context {report.decode[0].context}"
    )
    return plot_roofline(report.hardware, pts, path, dtype=report.act_dtype, title=title)


def _place_labels(fig: Any, ax: Any, labels: list[tuple[str, Point]], points: list[Point]) -> None:
    """Label each point next to it — prefill labels above the roof line, decode labels below — trying
    offsets further away (with a leader line back to the point), on either side, until the label
    overlaps no other label, no point, not the legend and stays inside the axes: no two labels ever
    print over each other."""
    from matplotlib.transforms import Bbox

    renderer = fig.canvas.get_renderer()
    legend = ax.get_legend()
    taken = [legend.get_window_extent(renderer)] if legend is not None else []
    for q in points:  # the markers themselves (~7 px across)
        x, y = ax.transData.transform((q.intensity, q.flops_per_s))
        taken.append(Bbox.from_extents(x - 3.5, y - 3.5, x + 3.5, y + 3.5))
    inside = ax.get_window_extent(renderer)
    for text, p in labels:
        first = -12 if p.stage == "decode" else 4
        signs = (-1, 1) if first < 0 else (1, -1)
        shifts = [first] + [first + sign * 9 * k for k in range(1, 20) for sign in signs]
        candidates = [(dx, dy) for dy in shifts for dx in (5, -5)]
        for attempt, (dx, dy) in enumerate(candidates):
            ann = ax.annotate(
                text, (p.intensity, p.flops_per_s), fontsize=6, xytext=(dx, dy), textcoords="offset points",
                ha="left" if dx > 0 else "right", color=STAGE_COLOURS.get(p.stage, "tab:gray"),
                arrowprops={"arrowstyle": "-", "lw": 0.4, "color": "0.6"} if attempt > 1 else None,
            )
            ann.set_in_layout(False)
            box = ann.get_window_extent(renderer)
            fits = inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1
            if fits and not any(box.overlaps(t) for t in taken):
                taken.append(box)
                break
            ann.remove()  # no free place at all (very crowded plots): the legend and markers still tell
