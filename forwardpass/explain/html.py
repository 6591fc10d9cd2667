"""A single self-contained HTML file of an explanation: inline SVG figures, no scripts, no external files."""

from __future__ import annotations

import html
import json
import math
from typing import Any

from forwardpass.analysis.report import fmt_bytes, fmt_flops, fmt_rate, fmt_time
from forwardpass.explain.speculation import speculation_html

_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222;background:#fff}
h1{font-size:1.5em}h2{font-size:1.15em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.5em 0}
td,th{padding:2px 8px;border-bottom:1px solid #eee;text-align:left}
.tok{display:inline-block;margin:2px;padding:2px 5px;border-radius:4px;background:#e8f0fe;
font-family:monospace}
.tok.split{background:#fde2e4;border-bottom:3px solid #c2185b}.id{color:#777;font-size:.8em}
.drawn{font-weight:bold;color:#c2185b}.no{color:#bbb}.mono{font-family:monospace}
.note{color:#666;font-size:.9em}
.tok.acc{background:#e3f4e4}.tok.rej{background:#fde2e2;text-decoration:line-through;color:#c62828}
"""


def _e(x: Any) -> str:
    return html.escape(str(x))


def _show(text: str) -> str:
    return _e(repr(text)[1:-1] or "∅")


def _color(v: float) -> str:
    v = max(0.0, min(1.0, v))
    r, g, b = int(255 - 200 * v), int(255 - 170 * v), int(255 - 60 * v)
    return f"rgb({r},{g},{b})"


def heatmap(rows: list[list[float]], row_labels: list[str], col_labels: list[str], *, cell: int = 20,
            title: str = "", vmax: float | None = None, mask_upper: bool = False,
            right_labels: list[str] | None = None) -> str:
    n_r, n_c = len(rows), len(rows[0]) if rows else 0
    left, top = 90, 70
    w, h = left + n_c * cell + (90 if right_labels else 10), top + n_r * cell + 10
    vmax = vmax or max((v for r in rows for v in r), default=1.0) or 1.0
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img" '
           f'aria-label="{_e(title)}">']
    for j, lab in enumerate(col_labels):
        x = left + j * cell + cell / 2
        out.append(f'<text x="{x}" y="{top - 4}" font-size="9" '
                   f'transform="rotate(-60 {x} {top - 4})">{_e(lab)}</text>')
    for i, row in enumerate(rows):
        y = top + i * cell
        out.append(f'<text x="{left - 4}" y="{y + cell - 3}" font-size="9" '
                   f'text-anchor="end">{_e(row_labels[i])}</text>')
        if right_labels:
            out.append(f'<text x="{left + n_c * cell + 6}" y="{y + cell - 5}" '
                       f'font-size="10">{_e(right_labels[i])}</text>')
        for j, v in enumerate(row):
            if mask_upper and j > i:
                fill = "#f4f4f4"
            else:
                fill = _color(v / vmax)
            out.append(f'<rect x="{left + j * cell}" y="{y}" width="{cell - 1}" height="{cell - 1}" '
                       f'fill="{fill}">'
                       f"<title>{_e(row_labels[i])} → {_e(col_labels[j])}: {v:.3g}</title></rect>")
    out.append("</svg>")
    return "".join(out)


def kv_strip(ex: dict[str, Any]) -> str:
    """The KV cache after each step: one square per entry, blocks outlined; prefill fills at once."""
    steps = (([("prefill", ex["prefill"])] if ex["prefill"] else [])
             + [(f"step {d['step']}", d) for d in ex["decode"]])
    bs = ex["engine"]["block_size"]
    total = max((d["kv_entries"] for _, d in steps), default=1)
    cell = max(4, min(14, 900 // max(total, 1)))
    w, h = 90 + total * cell + 20, 10 + len(steps) * (cell + 6)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img" '
           'aria-label="KV cache">']
    prev = 0
    for i, (name, d) in enumerate(steps):
        y = 5 + i * (cell + 6)
        out.append(f'<text x="84" y="{y + cell - 1}" font-size="10" text-anchor="end">{_e(name)}</text>')
        for k in range(d["kv_entries"]):
            fill = "#c2185b" if k >= prev else "#1e88e5"
            out.append(f'<rect x="{90 + k * cell}" y="{y}" width="{cell - 1}" height="{cell}" '
                       f'fill="{fill}"/>')
        for b in range(math.ceil(d["kv_entries"] / bs)):
            out.append(f'<rect x="{90 + b * bs * cell - 0.5}" y="{y - 1}" width="{bs * cell}" '
                       f'height="{cell + 2}" fill="none" stroke="#333" stroke-width="0.6"/>')
        prev = d["kv_entries"]
    out.append("</svg>")
    return "".join(out)


def roofline_svg(ex: dict[str, Any]) -> str:
    rf = ex["roofline"]
    hw = rf["hardware"]
    pts = rf["points"]
    if not hw or not pts:
        return "<p class=note>no hardware given: no roofline</p>"
    peak, bw = hw["peak_flops"], hw["bandwidth"]
    xs = [p["intensity"] for p in pts if p["intensity"] > 0]
    x0, x1 = math.log10(min(xs + [hw["ridge"]]) / 10), math.log10(max(xs + [hw["ridge"]]) * 10)
    ys = [p["achieved_flops_per_s"] for p in pts] + [p["predicted_flops_per_s"] or peak for p in pts]
    y0, y1 = math.log10(max(min(v for v in ys if v > 0), 1.0) / 10), math.log10(peak * 3)
    W, H, L, T = 640, 380, 70, 20

    def px(x: float) -> float:
        return L + (math.log10(x) - x0) / (x1 - x0) * (W - L - 20)

    def py(y: float) -> float:
        return T + (y1 - math.log10(max(y, 1e-30))) / (y1 - y0) * (H - T - 40)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" role="img" '
           'aria-label="roofline">',
           f'<rect x="{L}" y="{T}" width="{W - L - 20}" height="{H - T - 40}" fill="none" stroke="#999"/>']
    roof = []
    for k in range(101):
        x = 10 ** (x0 + (x1 - x0) * k / 100)
        roof.append(f"{px(x):.1f},{py(min(peak, bw * x)):.1f}")
    out.append(f'<polyline points="{" ".join(roof)}" fill="none" stroke="#333" stroke-width="2"/>')
    for d in range(math.ceil(x0), math.floor(x1) + 1):
        out.append(f'<text x="{px(10**d)}" y="{H - 22}" font-size="10" text-anchor="middle">1e{d}</text>')
    for d in range(math.ceil(y0), math.floor(y1) + 1):
        out.append(f'<text x="{L - 4}" y="{py(10**d) + 3}" font-size="10" text-anchor="end">1e{d}</text>')
    out.append(f'<text x="{W / 2}" y="{H - 6}" font-size="11" text-anchor="middle">arithmetic intensity '
               '(FLOP/byte)</text>')
    out.append(f'<text x="12" y="{H / 2}" font-size="11" transform="rotate(-90 12 {H / 2})" '
               'text-anchor="middle">FLOP/s</text>')
    for p in pts:
        color = "#c2185b" if p["stage"] == "prefill" else "#1e88e5"
        x = px(max(p["intensity"], 10**x0))
        if p["predicted_flops_per_s"]:
            y = py(p["predicted_flops_per_s"])
            out.append(f'<rect x="{x - 4}" y="{y - 4}" width="8" height="8" fill="none" stroke="{color}">'
                       f'<title>{p["stage"]} {p["step"]} predicted ({p["bound"]})</title></rect>')
        out.append(f'<circle cx="{x}" cy="{py(p["achieved_flops_per_s"])}" r="4" fill="{color}">'
                   f'<title>{p["stage"]} {p["step"]} measured</title></circle>')
    out.append(f'<text x="{L + 8}" y="{T + 14}" font-size="11">● measured  □ predicted (compute, memory + '
               'overhead) · <tspan fill="#c2185b">prefill</tspan> '
               '<tspan fill="#1e88e5">decode</tspan></text>')
    out.append("</svg>")
    return "".join(out)


def render_html(ex: dict[str, Any]) -> str:
    p = ex["params"]
    head = ("<!doctype html><html><head><meta charset=utf-8><title>forwardpass explain</title>"
            f"<style>{_CSS}</style>")
    parts = [head + "</head><body>", f"<h1>forwardpass explain · {_e(ex['model'])}</h1>",
             f"<p class=mono id=params>{_e(json.dumps(p))}</p>"]
    parts.append("<h2>1. Tokenization</h2><div id=tokens>")
    for t in ex["tokens"]:
        parts.append(f'<span class="tok{" split" if t["split"] else ""}" title="piece {_e(t["piece"])}">'
                     f'{_show(t["text"])} <span class=id>{t["id"]}</span></span>')
    parts.append("</div><p class=note>pink, underlined: a word split into several tokens</p>")
    pf = ex["prefill"]
    parts.append("<h2>2. Prefill and the KV cache</h2>")
    if pf:
        parts.append(f"<p id=prefill>{pf['tokens']} prompt tokens in {pf['steps']} forward pass(es): "
                     f"{fmt_time(pf['time_s'])}, {fmt_flops(pf['flops'])}, {fmt_bytes(pf['bytes'])}, bound: "
                     f"<b>{_e(pf['bound'])}</b>. The KV cache fills at once with {pf['kv_entries']} "
                     "entries.</p>")
    parts.append(kv_strip(ex))
    parts.append("<p class=note>one square per cached token (blue: there before the step, pink: written by "
                 f"it); outlines are KV blocks of {ex['engine']['block_size']} tokens</p>")
    parts.append("<h2>3. Decode steps</h2><table id=decode><tr><th>step</th><th>token</th><th>KV entries</th>"
                 "<th>time</th><th>FLOPs</th><th>bytes</th><th>bound</th><th>pool</th>"
                 "<th>top of the pool</th></tr>")
    for d in ([{"step": "prefill", **pf}] if pf else []) + ex["decode"]:
        top = ", ".join(f"{_show(c['text'])} {c['prob']:.2f}" for c in d["candidates"][:4])
        parts.append(f"<tr><td>{d['step']}</td><td class=drawn>{_show(d['text'])}</td>"
                     f"<td>{d['kv_entries']}</td><td>{fmt_time(d['time_s'])}</td><td>{fmt_flops(d['flops'])}</td><td>{fmt_bytes(d['bytes'])}</td>"
                     f"<td>{_e(d['bound'])}</td><td>{d['pool_size']}</td><td>{top}</td></tr>")
    parts.append("</table>")
    parts.append(speculation_html(ex.get("speculation"), _show))  # drafts per verify step, if speculating
    parts.append("<h2>4. The sampling funnel</h2>")
    for d in ([{"step": "prefill", **pf}] if pf else []) + ex["decode"][:5]:
        verdict = ("reproduced" if d["verified"] else "not reproduced" if d["verified"] is False
                   else "unseeded")
        parts.append(f"<h3>{_e(d['step'])}: drew <span class=drawn>{_show(d['text'])}</span> "
                     f"({verdict})"
                     "</h3><table class=funnel><tr><th>token</th><th>raw p</th><th>after temperature</th>"
                     "<th>min_p</th><th>top_k</th><th>top_p</th><th>pool p</th></tr>")
        for c in d["funnel"]:
            def ok(v: bool) -> str:
                return "✓" if v else "<span class=no>✗</span>"
            parts.append(f"<tr{' class=drawn' if c['drawn'] else ''}><td>{_show(c['text'])}</td>"
                         f"<td>{c['raw_prob']:.3f}</td><td>{c['temp_prob']:.3f}</td><td>{ok(c['min_p'])}</td>"
                         f"<td>{ok(c['top_k'])}</td><td>{ok(c['top_p'])}</td><td>{c['pool_prob']:.3f}</td></tr>")
        parts.append(f"</table><p class=note>pool: {d['pool_size']} tokens</p>")
    labels = [(repr(s["text"])[1:-1] or "∅")[:10] for s in ex["sequence"]]  # heatmap() escapes them
    if ex["layers"]:
        parts.append("<h2>5. The signal through the layers</h2><p class=note>L2 norm of each token's hidden "
                     "state after the embedding and after each decoder layer</p>")
        parts.append(heatmap([layer["norms"] for layer in ex["layers"]],
                             [layer["name"] for layer in ex["layers"]], labels, title="hidden-state norms",
                             right_labels=[f"mean {layer['mean_norm']:.3g}" for layer in ex["layers"]]))
    a = ex["attention"]
    if a:
        parts.append(f"<h2>6. Attention: layer {a['layer']}, head {a['head']}</h2>"
                     "<p class=note>rows are queries, columns keys; grey above the diagonal is the causal "
                     "mask</p>")
        parts.append(heatmap(a["weights"], labels, labels, title="attention weights", vmax=1.0,
                             mask_upper=True))
    if ex["routing"]:
        parts.append("<h2>7. MoE routing</h2>")
        for r in ex["routing"]:
            grid = [[0.0] * r["num_experts"] for _ in r["experts"]]
            for i, (es, ws) in enumerate(zip(r["experts"], r["weights"])):
                for e, w in zip(es, ws):
                    grid[i][e] = w
            parts.append(f"<h3>layer {r['layer']}</h3>")
            parts.append(heatmap(grid, labels, [str(e) for e in range(r["num_experts"])], title="routing"))
    rf = ex["roofline"]
    parts.append("<h2>8. Roofline</h2>")
    if rf["hardware"]:
        hw, oh = rf["hardware"], rf["overhead"]
        parts.append(f"<p>{_e(hw['label'])}: peak {fmt_rate(hw['peak_flops'], 'FLOP/s')}, "
                     f"{fmt_rate(hw['bandwidth'], 'B/s')}"
                     + (f"; overhead {fmt_time(oh['per_step_s'])} per step + {fmt_time(oh['per_layer_s'])} "
                        "per layer (measured)" if oh else "") + "</p>")
    parts.append(roofline_svg(ex))
    # --batching: decode steps beside copies of the prompt (explain/batching.py)
    if rows := ex.get("batching"):
        pct = lambda x: f"{100 * x:.1f}%" if x is not None else "-"  # noqa: E731
        parts.append("<h2>9. Batching raises arithmetic intensity</h2><table id=batching><tr><th>batch</th>"
                     "<th>ms / step</th><th>tokens/s</th><th>FLOP/s</th><th>MFU</th><th>bytes/s</th>"
                     "<th>MBU</th><th>FLOP / byte</th><th>bound</th></tr>")
        for r in rows:
            parts.append(f"<tr><td>{r['batch']}</td><td>{1e3 * r['time_s'] / r['steps']:.1f}</td>"
                         f"<td>{r['tokens_per_s']:.1f}</td>"
                         f"<td>{fmt_rate(r['achieved_flops_per_s'], 'FLOP/s')}</td>"
                         f"<td>{pct(r.get('mfu'))}</td><td>{fmt_rate(r['achieved_bytes_per_s'], 'B/s')}</td>"
                         f"<td>{pct(r.get('mbu'))}</td><td>{r['intensity']:.3g}</td>"
                         f"<td>{_e(r.get('regime') or r.get('bound') or '-')}</td></tr>")
        parts.append("</table><p class=note>the prompt decoded beside copies of itself: each step reads "
                     "every weight once, so FLOPs grow with the batch and bytes hardly do</p>")
    parts.append(f"<h2>Completion</h2><p class=mono id=completion>{_e(ex['completion'])}</p>"
                 f"<p id=verified>every draw reproduced from the recomputed logits: {ex['verified']}</p>")
    parts.append("</body></html>")
    return "".join(parts)
