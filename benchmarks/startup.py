"""Start-up of the CLI, from process start: to the first token of ``generate`` and ``chat``, to the transcript
of ``transcribe``, to ``/health`` answering 200 for ``serve``; plus ``python -X importtime``'s heaviest
imports of ``generate``.

Run it on quiet cores, the kernels built (``forwardpass warmup``; ``--warmup`` runs it first in ``--tree``):

    python benchmarks/startup.py                          # this checkout
    git worktree add /tmp/before <commit>                 # to compare with another version, in turn:
    python benchmarks/startup.py --tree /tmp/before --tree . --warmup

Each command runs ``--repeat`` times in a fresh interpreter (``python -m forwardpass``, ``PYTHONPATH`` the
tree; several trees in turn); the median is printed (``--json`` for a script). ``transcribe`` reads
``--clip`` (made with espeak-ng when missing: "hello world", 22.05 kHz, so it is resampled too) with
``--speech-model`` (default tiny.en).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}


def first_output(cmd: list[str], tree: Path, stdin: bytes | None = None, skip: int = 0,
                 timeout: float = 300) -> float:
    """Seconds from starting ``cmd`` to its first stdout byte after the first ``skip`` (the echoed prompt)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=_env(tree), cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    if stdin is not None:
        proc.stdin.write(stdin)
    proc.stdin.close()
    seen, took = 0, None
    while time.perf_counter() - start < timeout:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if not ready:
            continue
        chunk = os.read(proc.stdout.fileno(), 65536)
        if not chunk:
            break
        seen += len(chunk)
        if took is None and seen > skip:
            took = time.perf_counter() - start
    proc.kill()
    proc.wait()
    if took is None:
        raise SystemExit(f"no output from {' '.join(cmd)} (exit {proc.returncode})")
    return took


def health_after(cmd: list[str], tree: Path, timeout: float = 300) -> float:
    """Seconds from starting ``serve`` to ``GET /health`` answering 200."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.perf_counter()
    proc = subprocess.Popen([*cmd, "--port", str(port)], env=_env(tree), cwd=tree, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        while time.perf_counter() - start < timeout:
            if proc.poll() is not None:
                raise SystemExit(f"serve exited ({proc.returncode}) before /health answered")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - start
            except OSError:
                time.sleep(0.05)
        raise SystemExit("serve: /health did not answer 200 in time")
    finally:
        proc.terminate()
        proc.wait()


def heaviest_imports(tree: Path, n: int = 8) -> list[tuple[str, float]]:
    """``-X importtime`` of ``generate "Hi" --max-tokens 1``: the top-level imports by cumulative ms."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "forwardpass", "generate", "Hi",
                           "--max-tokens", "1"], env=_env(tree), cwd=tree, capture_output=True, text=True)
    rows = []
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        _, cumulative, name = line.split("|", 2)
        if len(name) - len(name.lstrip()) <= 1:  # imported by the program itself, not by another module
            rows.append((name.strip(), int(cumulative) / 1000))
    return sorted(rows, key=lambda r: -r[1])[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", type=Path, action="append", default=None,
                    help="a checkout to run (default: this one); repeat it to compare checkouts, run in turn "
                    "(A B A B ...) so that load from other work falls on both alike")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--model", default=None, help="generate / chat / serve --model (default: the embedded)")
    ap.add_argument("--speech-model", default="tiny.en")
    ap.add_argument("--clip", type=Path, default=Path("/tmp/forwardpass-startup-clip.wav"))
    ap.add_argument("--commands", default="generate,chat,transcribe,serve")
    ap.add_argument("--warmup", action="store_true", help="run `forwardpass warmup` in each --tree first")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    trees = [t.resolve() for t in (args.tree or [REPO])]
    names = args.commands.split(",")
    fp = [sys.executable, "-m", "forwardpass"]
    if args.warmup:
        for tree in trees:
            subprocess.run([*fp, "warmup"], env=_env(tree), cwd=tree, check=True)
    if not args.clip.exists():
        if shutil.which("espeak-ng") is None:
            raise SystemExit(f"--clip {args.clip} is missing and espeak-ng is not installed to make it")
        subprocess.run(["espeak-ng", "-w", str(args.clip), "hello world"], check=True)
    model = ["--model", args.model] if args.model else []

    def run(name: str, tree: Path) -> float:
        if name == "generate":
            return first_output([*fp, "generate", "Hi", "--max-tokens", "1", *model], tree, skip=2)
        if name == "chat":
            return first_output([*fp, "chat", "--max-tokens", "1", *model], tree, stdin=b"Hi\n")
        if name == "transcribe":
            return first_output([*fp, "transcribe", str(args.clip), "--model", args.speech_model], tree)
        return health_after([*fp, "serve", *model], tree)

    load = [os.getloadavg()[0]]
    times: dict[Path, dict[str, list[float]]] = {t: {n: [] for n in names} for t in trees}
    for _ in range(args.repeat):
        for name in names:
            for tree in trees:  # in turn, so that a burst of load falls on every tree alike
                times[tree][name].append(run(name, tree))
    load.append(os.getloadavg()[0])
    figures = {"cores": len(os.sched_getaffinity(0)), "load_average_before_after": load, "trees": {
        str(t): {**{n: {"median_s": round(statistics.median(v), 2), "runs_s": [round(x, 2) for x in v]}
                    for n, v in times[t].items()},
                 "heaviest_imports_ms": {k: round(v) for k, v in heaviest_imports(t)}}
        for t in trees}}
    if args.json:
        print(json.dumps(figures, indent=1))
        return
    print(f"{figures['cores']} cores, load average {load[0]:.1f} before, {load[1]:.1f} after")
    for tree, f in figures["trees"].items():
        print(tree)
        for name in names:
            runs = ", ".join(f"{t:.2f}" for t in f[name]["runs_s"])
            print(f"  {name:<11} {f[name]['median_s']:6.2f} s  (runs: {runs})")
        print("  heaviest imports of generate (cumulative ms): "
              + ", ".join(f"{k} {v}" for k, v in f["heaviest_imports_ms"].items()))


if __name__ == "__main__":
    main()
