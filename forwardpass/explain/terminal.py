"""Terminal rendering of an explanation (``rich``)."""

from __future__ import annotations

from typing import Any

from forwardpass.analysis.report import fmt_ai, fmt_bytes, fmt_flops, fmt_rate, fmt_time
from forwardpass.explain.speculation import render_speculation

_SHADES = " ░▒▓█"


def _bar(frac: float, width: int = 24) -> str:
    n = max(0, min(width, round(frac * width)))
    return "█" * n + "·" * (width - n)


def _mark(ok: bool) -> str:
    return "✓" if ok else "✗"


def _show(text: str) -> str:
    return repr(text)[1:-1] if text else "∅"


def plan_line(plan: dict[str, Any]) -> str:
    """The execution plan in one line: device, dtype, weight methods, compiled kernels, ISA, variables set."""
    if loaded := plan.get("loaded_weights"):  # what the weights really are (a GGUF file's own types)
        weights = "; ".join(f"{role.replace('_', ' ')} {what}" for role, what in loaded.items())
    else:
        w = plan["weights"]
        weights = w["projection"] + (f", head {w['lm_head']}" if w["lm_head"] != w["projection"] else "")
    kernels = [k for k in ("decode_kernel", "fused_ops", "small_matmul", "decode_stack", "huge_pages",
                           "batch_invariant", "lora_slots") if plan.get(k)]
    parts = [f"execution plan: {plan['device']} {plan['dtype']}", f"weights {weights}",
             f"KV cache {plan.get('kv_cache_dtype', plan['dtype'])}",
             "kernels " + (", ".join(kernels) if kernels else "none (PyTorch)")]
    if plan.get("isa"):
        parts.append("isa " + ", ".join(f"{k}={v}" for k, v in plan["isa"].items()))
    if plan.get("env"):
        parts.append("env " + " ".join(f"{k}={v}" for k, v in plan["env"].items()))
    return " · ".join(parts)


def _predicted(d: dict) -> str:
    return f"{fmt_time(d['predicted_s'])} ({d['ratio']:.1f}x)" if d.get("predicted_s") else "-"


def _regime(d: dict) -> str:
    """The measured regime (overhead when > 3x the prediction: analysis/regime.py), else the prediction's."""
    regime = d.get("regime") or d["bound"]
    return f"[yellow]{regime}[/]" if d.get("cause") else str(regime)


def render(ex: dict[str, Any], out: Any = None, *, funnels: int = 3) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    con = out or Console()
    if out is None and not con.is_terminal:
        con = Console(width=140)  # piped: wide enough for the tables
    p = ex["params"]
    con.rule(f"[bold]forwardpass explain[/] · {ex['model']} ({ex['architecture']})")
    con.print(f"temperature {p['temperature']}  top_k {p['top_k']}  top_p {p['top_p']}  min_p {p['min_p']}  "
              f"seed {p['seed']}  max_tokens {p['max_tokens']}")
    if plan := ex.get("execution_plan"):
        con.print(plan_line(plan), style="dim", markup=False)

    # tokenization
    t = Text("\nprompt tokens: ")
    for i, tok in enumerate(ex["tokens"]):
        style = "bold magenta underline" if tok["split"] else ("cyan" if i % 2 else "green")
        t.append(f"[{_show(tok['text'])}|{tok['id']}]", style=style)
    con.print(t)
    con.print("[dim]underlined: a word split into several tokens[/]")

    # prefill
    pf = ex["prefill"]
    if pf:
        con.print(f"\n[bold]prefill[/]: {pf['tokens']} tokens in one pass, {fmt_time(pf['time_s'])}, "
                  f"{fmt_flops(pf['flops'])}, {fmt_bytes(pf['bytes'])} → bound: [bold]{pf['bound']}[/]")
        con.print(f"  KV cache filled at once: {pf['kv_entries']} entries in {pf['kv_blocks']} block(s) "
                  f"{'▇' * pf['kv_entries']}")

    # decode steps
    tab = Table(title="decode steps (the first token was drawn by the prefill)", show_lines=False)
    for col in ("step", "token", "KV entries", "time", "predicted", "FLOPs", "bytes", "regime", "pool"):
        tab.add_column(col, no_wrap=True)
    tab.add_column("top of the pool", no_wrap=True, overflow="ellipsis")
    rows = ([{"step": 0, **pf}] if pf else []) + ex["decode"]
    for d in rows:
        top = "  ".join(f"{_show(c['text'])} {c['prob']:.2f}" for c in d["candidates"][:3])
        tab.add_row(str(d["step"]) if d["step"] else "prefill", _show(d["text"]),
                    str(d["kv_entries"]), fmt_time(d["time_s"]), _predicted(d),
                    fmt_flops(d["flops"]), fmt_bytes(d["bytes"]), _regime(d), str(d["pool_size"]), top)
    con.print(tab)
    render_speculation(con, ex.get("speculation"), _show)  # drafts per step, with a speculative_config
    causes = {d["cause_text"] for d in rows if d.get("cause_text")}
    for cause in sorted(causes):  # why steps ran > 3x their prediction (analysis/regime.py)
        con.print(f"[yellow]overhead-bound steps[/]: {cause}")
    con.print("[bold]the KV cache, step by step[/] (one ▇ per cached token; the last one was written by the "
              "step)")
    for d in rows:
        n = d["kv_entries"]
        con.print(f"  {('prefill' if not d['step'] else 'step ' + str(d['step'])):>8} "
                  f"[blue]{'▇' * (n - 1 if d['step'] else 0)}[/][magenta]{'▇' * (1 if d['step'] else n)}[/] "
                  f"{n}")

    # sampling funnels
    for d in rows[:funnels]:
        verdict = "verified" if d["verified"] else "NOT reproduced" if d["verified"] is False else "unseeded"
        f = Table(title=f"sampling funnel → drew {_show(d['text'])} ({verdict})")
        for col in ("token", "raw p", "after T", "min_p", "top_k", "top_p", "pool p"):
            f.add_column(col)
        for c in d["funnel"]:
            f.add_row(("→ " if c["drawn"] else "  ") + _show(c["text"]), f"{c['raw_prob']:.3f}",
                      f"{c['temp_prob']:.3f}", _mark(c["min_p"]), _mark(c["top_k"]), _mark(c["top_p"]),
                      f"{c['pool_prob']:.3f}")
        con.print(f)

    # the signal through the layers
    if ex["layers"]:
        con.print("\n[bold]hidden-state norm per layer[/] (mean over tokens; the signal through the network)")
        top = max(layer["mean_norm"] for layer in ex["layers"]) or 1.0
        for layer in ex["layers"]:
            con.print(f"  {layer['name']:>10}  {_bar(layer['mean_norm'] / top)}  {layer['mean_norm']:.2f}")
    else:
        con.print("\n[dim]no per-layer views: this architecture's layers are not the Llama-family decoder[/]")

    # attention heatmap
    a = ex["attention"]
    if a:
        w = a["weights"]
        n = min(len(w), 32)
        con.print(f"\n[bold]attention of layer {a['layer']}, head {a['head']}[/] (rows: queries, columns: "
                  "keys; blank above the diagonal is the causal mask)")
        labels = [_show(s["text"])[:8] for s in ex["sequence"]]
        for i in range(n):
            cells = "".join(_SHADES[min(4, int(w[i][j] * 5))] * 2 if j <= i else "  " for j in range(n))
            con.print(f"  {labels[i]:>8} {cells}")

    # MoE routing
    for r in ex["routing"]:
        counts = [0] * r["num_experts"]
        for experts in r["experts"]:
            for e in experts:
                counts[e] += 1
        con.print(f"  MoE layer {r['layer']}: tokens per expert {counts}")

    # roofline
    rf = ex["roofline"]
    if rf["hardware"]:
        hw, oh = rf["hardware"], rf["overhead"]
        con.print(f"\n[bold]roofline[/] on {hw['label']}: peak {fmt_rate(hw['peak_flops'], 'FLOP/s')}, "
                  f"{fmt_rate(hw['bandwidth'], 'B/s')}")
        if oh:
            con.print(f"  overhead measured: {fmt_time(oh['per_step_s'])} per step + "
                      f"{fmt_time(oh['per_layer_s'])} per layer")
        for pt in rf["points"][:12]:
            pred = pt["predicted_flops_per_s"]
            con.print(f"  {pt['stage']:>7} {pt['step']:>3}: intensity {pt['intensity']:.2f} FLOP/B, measured "
                      f"{fmt_rate(pt['achieved_flops_per_s'], 'FLOP/s')}, predicted "
                      f"{fmt_rate(pred, 'FLOP/s') if pred else '-'} ({pt['bound']})")
    render_batching(con, ex.get("batching"), (ex["roofline"]["hardware"] or {}).get("label"))
    con.print(f"\ncompletion: {ex['completion']!r}   draws reproduced: {ex['verified']}")


def render_batching(con: Any, rows: list[dict] | None, hardware: str | None) -> None:
    """``--batching``: decode steps of the prompt beside copies of itself, by batch size
    (explain/batching.py)."""
    from rich.table import Table

    if not rows:
        return
    tab = Table(title="batching raises arithmetic intensity: decode steps as the batch grows"
                + (f" (shares of {hardware}'s roofs)" if hardware else ""))
    for col in ("batch", "ms / step", "tokens/s", "FLOP/s", "MFU", "bytes/s", "MBU", "FLOP / byte", "bound"):
        tab.add_column(col, no_wrap=True)
    pct = lambda x: f"{100 * x:.1f}%" if x is not None else "-"  # noqa: E731
    for r in rows:
        tab.add_row(str(r["batch"]), f"{1e3 * r['time_s'] / r['steps']:.1f}", f"{r['tokens_per_s']:.1f}",
                    fmt_rate(r["achieved_flops_per_s"], "FLOP/s"), pct(r.get("mfu")),
                    fmt_rate(r["achieved_bytes_per_s"], "B/s"), pct(r.get("mbu")), fmt_ai(r["intensity"]),
                    str(r.get("regime") or r.get("bound") or "-"))
    con.print(tab)
