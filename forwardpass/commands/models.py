"""``forwardpass models``: the models this machine can run without a download.

Every kind (text, image, video, speech) from the one registry (``forwardpass/registry.py``): the embedded
models, installed packages of real weights and the Hugging Face cache (``HF_HOME``), each with whether
forwardpass supports its architecture. Each name is accepted by ``--model`` of the commands of its kind.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list every model this machine can run (text, image, video, speech)",
                       description="List the models usable offline: embedded ones, installed packages of "
                       "real weights and the Hugging Face cache (HF_HOME / HF_HUB_CACHE). Pass a listed name "
                       "to --model, e.g. forwardpass serve --model ORG/NAME.")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


_SOURCE = {"embedded": "embedded", "package": "package", "hf-cache": "HF cache", "local": "local"}


def run(args: argparse.Namespace) -> int:
    import json

    from forwardpass.loader.hub import hub_cache_dir
    from forwardpass.registry import list_models

    rows = []
    for m in list_models():  # forwardpass/registry.py: the names every command and /v1/models resolve
        row = m.to_dict()
        row["type"], row["kind"] = m.kind, f"{m.kind} ({_SOURCE[m.source]})"
        rows.append(row)
    if args.json:
        print(json.dumps({"hub_cache": str(hub_cache_dir()), "models": rows}, indent=2))
        return 0
    width = max(len(r["model"]) for r in rows)
    print(f"{'MODEL':<{width}}  {'KIND':<18}  {'SIZE':>9}  NOTE")
    for r in rows:
        rev = f" [{', '.join(r['revisions'])}]" if r["revisions"] else ""
        print(f"{r['model']:<{width}}  {r['kind']:<18}  {_size(r['size_bytes']):>9}  {r['note']}{rev}")
    cached = sum(1 for r in rows if r["source"] == "hf-cache")
    print(f"\n{cached} model(s) in the Hugging Face cache at {hub_cache_dir()}"
          + ("" if cached else " (download one with: hf download ORG/NAME, or forwardpass serve "
                               "--model ORG/NAME)"))
    return 0
