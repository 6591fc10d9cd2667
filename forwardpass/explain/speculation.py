"""What speculative decoding did in an explained request (``forwardpass explain --speculative-config``).

Per engine step that verified drafts: the tokens proposed, the prefix of them the target accepted, the ones
it rejected (the first disagreed with the target's own token; the ones after it went with it) and the tokens
the step emitted (the accepted drafts plus the target's next token). Read from the engine's ``StepRecord``
(``draft_token_ids``, ``acceptance_lengths``): the engine's own account, not a re-computation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from forwardpass.engine.scheduling.stats import StepRecord


def speculation_steps(steps: Sequence[tuple[StepRecord, list[int]]],
                      text: Callable[[int], str]) -> dict[str, Any] | None:
    """The per-step drafts of a one-request run (``steps``: each record with the tokens generated so far);
    None when no step verified drafts."""
    entries: list[dict[str, Any]] = []
    seen = decode_steps = 0
    for rec, generated in steps:
        new = generated[seen:]
        seen = len(generated)
        decode_steps += bool(new) and not rec.num_prefill_tokens
        if not rec.draft_token_ids:
            continue
        drafts, length = rec.draft_token_ids[0], rec.acceptance_lengths[0]
        entries.append({
            "engine_step": rec.step,
            "proposed": [{"id": t, "text": text(t)} for t in drafts],
            "accepted": length - 1,  # the first ``accepted`` of ``proposed``
            "rejected": [{"id": t, "text": text(t)} for t in drafts[length - 1:]],
            "emitted": [{"id": t, "text": text(t)} for t in new],
        })
    if not entries:
        return None
    proposed = sum(len(e["proposed"]) for e in entries)
    accepted = sum(e["accepted"] for e in entries)
    tokens = len(steps[-1][1])  # generated in all; the first came from the prefill
    return {
        "steps": entries,
        "num_draft_tokens": proposed,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "mean_acceptance_length": (accepted + len(entries)) / len(entries),
        # decode tokens per decode forward pass (every pass reads every weight once)
        "tokens_per_forward_pass": (tokens - 1) / decode_steps if decode_steps else 0.0,
    }


def render_speculation(con: Any, spec: dict[str, Any] | None, show: Callable[[str], str]) -> None:
    """The drafts table of the terminal view: accepted drafts green, rejected ones red and struck through."""
    if not spec:
        return
    from rich.table import Table
    from rich.text import Text

    s = spec
    tab = Table(title=f"speculative decoding: {s['num_accepted_tokens']} of {s['num_draft_tokens']} drafts "
                      f"accepted ({s['acceptance_rate']:.0%}), {s['mean_acceptance_length']:.2f} tokens per "
                      f"verify step, {s['tokens_per_forward_pass']:.2f} tokens per decode pass")
    for col in ("engine step", "proposed", "accepted", "rejected", "emitted"):
        tab.add_column(col, overflow="fold")
    for e in spec["steps"]:
        proposed = Text()
        for i, t in enumerate(e["proposed"]):
            ok = i < e["accepted"]
            proposed.append(f"[{show(t['text'])}]", style="green" if ok else "red strike")
        tab.add_row(str(e["engine_step"]), proposed, str(e["accepted"]), str(len(e["rejected"])),
                    "".join(f"[{show(t['text'])}]" for t in e["emitted"]))
    con.print(tab)


def speculation_html(spec: dict[str, Any] | None, show: Callable[[str], str]) -> str:
    """The drafts section of the HTML report (``explain/html.py``): the same figures as the JSON, one table
    row per verifying step, and a bar per step (green: accepted drafts, red: rejected ones). ``show``
    escapes a token's text for HTML. Empty when no step verified drafts."""
    if not spec:
        return ""
    s = spec
    out = ["<h2>Speculative decoding</h2>",
           f"<p id=speculation>{s['num_accepted_tokens']} of {s['num_draft_tokens']} drafts accepted "
           f"({s['acceptance_rate']:.0%}); {s['mean_acceptance_length']:.2f} tokens per verify step; "
           f"{s['tokens_per_forward_pass']:.2f} tokens per decode forward pass</p>",
           "<table id=drafts><tr><th>engine step</th><th>drafts</th><th>proposed</th><th>accepted</th>"
           "<th>rejected</th><th>emitted</th></tr>"]
    widest = max(len(e["proposed"]) for e in s["steps"]) or 1
    for e in s["steps"]:
        n, ok = len(e["proposed"]), e["accepted"]
        cell = max(6, 120 // widest)
        bar = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{widest * cell}" height="12" role="img" '
               f'aria-label="{ok} of {n} accepted">'
               + "".join(f'<rect x="{i * cell}" y="1" width="{cell - 1}" height="10" '
                         f'fill="{"#2e7d32" if i < ok else "#c62828"}"/>' for i in range(n)) + "</svg>")
        proposed = "".join(f'<span class="tok {"acc" if i < ok else "rej"}">{show(t["text"])} '
                           f'<span class=id>{t["id"]}</span></span>' for i, t in enumerate(e["proposed"]))
        emitted = "".join(f'<span class=tok>{show(t["text"])} <span class=id>{t["id"]}</span></span>'
                          for t in e["emitted"])
        out.append(f"<tr class=verify><td>{e['engine_step']}</td><td>{bar}</td><td>{proposed}</td>"
                   f"<td class=accepted>{ok}</td><td class=rejected>{len(e['rejected'])}</td>"
                   f"<td>{emitted}</td></tr>")
    out.append("</table><p class=note>green: drafts the target accepted; red, struck through: drafts it "
               "rejected (the first disagreed with the target's own token, the rest went with it); emitted: "
               "the accepted drafts and the target's next token</p>")
    return "".join(out)
