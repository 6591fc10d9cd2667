"""Run vLLM's own OpenAI-server tests against ``forwardpass serve``.

    python -m benchmarks.vllm_openai_compat.run --vllm-src /path/to/vllm [-k EXPR] [--folders openai]

``--vllm-src`` is a vLLM source tree (a git checkout, or its PyPI sdist unpacked: vllm-0.32.0.tar.gz has
``tests/``). Nothing of vLLM is kept in this repository: at run time the harness copies the test folders
(plan.FOLDERS, under ``tests/entrypoints/``) into a temporary tree where ``tests/utils.py`` is our
``remote_server.py`` (RemoteOpenAIServer launches ``forwardpass serve``) and ``vllm`` imports resolve to
``vllm_stub``. Needs ``pytest-asyncio`` importable (``pip install pytest-asyncio``). Prints the counts
(applicable, passed, failed with their messages, left out with the reason) and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from benchmarks.vllm_openai_compat import plan

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
_CONFTEST = """from benchmarks.vllm_openai_compat import vllm_stub

vllm_stub.install()
pytest_plugins = ["benchmarks.vllm_openai_compat.plugin"]  # pytest-asyncio loads by its entry point
"""
_INI = "[pytest]\nasyncio_default_fixture_loop_scope = function\nasyncio_mode = strict\n"


def build_tree(vllm_src: Path, folders: list[str], root: Path) -> list[Path]:
    """The temporary test tree; returns the folders to run."""
    src = vllm_src / "tests" / "entrypoints"
    if not src.is_dir():
        raise SystemExit(f"{vllm_src} has no tests/entrypoints: pass a vLLM checkout or unpacked sdist")
    tests = root / "tests"
    (tests / "entrypoints").mkdir(parents=True)
    (tests / "__init__.py").write_text("")
    (tests / "entrypoints" / "__init__.py").write_text("")
    shutil.copy(HERE / "remote_server.py", tests / "utils.py")
    shutil.copy(src / "conftest.py", tests / "entrypoints" / "conftest.py")  # plain sample fixtures
    (root / "conftest.py").write_text(_CONFTEST)
    (root / "pytest.ini").write_text(_INI)
    runs = []
    for folder in folders:
        dest = tests / "entrypoints" / folder
        for parent in reversed(dest.relative_to(tests).parents[:-1]):
            (tests / parent).mkdir(exist_ok=True)
            (tests / parent / "__init__.py").touch()
        shutil.copytree(src / folder, dest)
        runs.append(dest)
    return runs


def summarize(result: dict) -> dict:
    """Counts from the raw records; ``plan.EXCLUDED`` is applied again here, so a revised table can be
    applied to a stored run (``--resummarize``) without running it again."""
    tests = {k: dict(v) for k, v in result["tests"].items()}
    for nodeid, v in tests.items():
        reason = next((r for p, r in plan.EXCLUDED if re.search(p, nodeid)), None)
        if reason is not None and v.get("status") != "excluded":
            v.update(status="excluded", reason=reason)
    counted = {k: v for k, v in tests.items() if v.get("status") in {"passed", "failed", "error"}}
    passed = sum(v["status"] == "passed" for v in counted.values())
    left_out = Counter(v["reason"] for v in tests.values() if v.get("status") == "excluded")
    for v in tests.values():
        if v.get("status") == "skipped":
            left_out[f"skipped by the test itself: {v.get('message', '')}"[:160]] += 1
    return {"applicable": len(counted), "passed": passed, "failed": len(counted) - passed,
            "pass_rate": round(passed / len(counted), 4) if counted else None,
            "left_out": dict(left_out.most_common()), "collection_errors": result["collection_errors"],
            "failures": {k: v.get("message", "") for k, v in counted.items() if v["status"] != "passed"},
            "raw": result}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-src", type=Path)
    ap.add_argument("--folders", nargs="*", default=list(plan.FOLDERS))
    ap.add_argument("-k", default=None, help="pytest -k expression")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/local/vllm_compat.json")
    ap.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    ap.add_argument("--resummarize", type=Path, default=None,
                    help="count a stored run (its JSON's 'raw') again with the current plan.EXCLUDED")
    args = ap.parse_args(argv)
    if args.resummarize is not None:
        return report(summarize(json.loads(args.resummarize.read_text())["raw"]), args.out)
    if args.vllm_src is None:
        ap.error("--vllm-src is required (or --resummarize)")
    root = Path(tempfile.mkdtemp(prefix="vllm-compat-"))
    try:
        runs = build_tree(args.vllm_src.resolve(), args.folders, root)
        raw = root / "result.json"
        path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env = {**os.environ, "FORWARDPASS_COMPAT_RESULT": str(raw), "PYTHONPATH": path,
               "FORWARDPASS_VLLM_SRC": str(args.vllm_src)}
        cmd = [sys.executable, "-m", "pytest", *map(str, runs), "--rootdir", str(root),
               "-c", str(root / "pytest.ini"),
               "-v", "-p", "no:cacheprovider", "--continue-on-collection-errors", "-rN", "--timeout", "900",
               *(["-k", args.k] if args.k else []), *args.pytest_args]
        subprocess.run(cmd, cwd=root, env=env)
        summary = summarize(json.loads(raw.read_text()))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return report(summary, args.out)


def report(summary: dict, out: Path) -> int:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: summary[k] for k in ("applicable", "passed", "failed", "pass_rate")}))
    for reason, n in summary["left_out"].items():
        print(f"  left out {n:4d}: {reason}")
    for path, err in summary["collection_errors"].items():
        print(f"  not importable: {path}: {err}")
    for nodeid, msg in summary["failures"].items():
        print(f"  FAILED {nodeid}: {msg.splitlines()[0] if msg else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
