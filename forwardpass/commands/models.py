"""``forwardpass models``: the models this machine can run without a download.

The embedded models (shipped in the package) and the Hugging Face cache (``HF_HOME``; see
``forwardpass/loader/hub.py``), each with whether forwardpass supports its architecture.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list the embedded models and those in the Hugging Face cache",
                       description="List the models usable offline: embedded ones and the Hugging Face cache "
                       "(HF_HOME / HF_HUB_CACHE). Pass a listed id to --model, e.g. "
                       "forwardpass serve --model ORG/NAME.")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def run(args: argparse.Namespace) -> int:
    import json

    from forwardpass.diffusion import DEFAULT_MODEL_DIR
    from forwardpass.loader.hub import cached_models, hub_cache_dir
    from forwardpass.models.registry import supported_architectures

    supported = set(supported_architectures())
    rows = []
    from forwardpass.assets import default_llm_path

    llm_dir = default_llm_path()
    for name, kind, path, note in (
        ("forwardpass-default", "text (embedded)", llm_dir, "the default of generate / chat / serve / LLM()"),
        ("digits", "image (embedded)", DEFAULT_MODEL_DIR, "the default of forwardpass image"),
    ):
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0
        rows.append({"model": name, "kind": kind, "size_bytes": size, "supported": True, "path": str(path),
                     "revisions": [], "note": note})
    from forwardpass.loader.gguf_packages import installed

    for name, path, note in installed():  # GGUF models from Python packages: --model NAME
        rows.append({"model": name, "kind": "text (package)", "size_bytes": path.stat().st_size,
                     "supported": True, "path": str(path), "revisions": [], "note": note})
    from forwardpass.loader.ctranslate2 import installed_packaged

    for name, path, note in installed_packaged():  # CTranslate2 (faster-whisper) speech models: --model NAME
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        rows.append({"model": name, "kind": "speech (package)", "size_bytes": size, "supported": True,
                     "path": str(path), "revisions": [], "note": note})
    for m in cached_models():
        ok = m.architecture in supported
        rows.append({"model": m.repo_id, "kind": "text (HF cache)", "size_bytes": m.size_bytes,
                     "supported": ok,
                     "path": str(m.path), "revisions": list(m.revisions),
                     "note": m.architecture if ok else f"{m.architecture}: architecture not supported"})
    if args.json:
        print(json.dumps({"hub_cache": str(hub_cache_dir()), "models": rows}, indent=2))
        return 0
    width = max(len(r["model"]) for r in rows)
    print(f"{'MODEL':<{width}}  {'KIND':<16}  {'SIZE':>9}  NOTE")
    for r in rows:
        rev = f" [{', '.join(r['revisions'])}]" if r["revisions"] else ""
        print(f"{r['model']:<{width}}  {r['kind']:<16}  {_size(r['size_bytes']):>9}  {r['note']}{rev}")
    cached = sum(1 for r in rows if r["kind"] == "text (HF cache)")
    print(f"\n{cached} model(s) in the Hugging Face cache at {hub_cache_dir()}"
          + ("" if cached else " (download one with: hf download ORG/NAME, or forwardpass serve "
                               "--model ORG/NAME)"))
    return 0
