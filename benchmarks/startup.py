"""Start-up of the CLI, from process start: to the first token of ``generate`` and ``chat``, to the transcript
of ``transcribe``, to ``/health`` answering 200 for ``serve``; plus ``python -X importtime``'s heaviest
imports of ``generate``.

Run it on quiet cores, the kernels built (``forwardpass warmup``; ``--warmup`` runs it first in ``--tree``):

    python benchmarks/startup.py                          # this checkout
    git worktree add /tmp/before <commit>                 # the same for another version, to compare:
    python benchmarks/startup.py --tree /tmp/before --warmup

Each command runs ``--repeat`` times in a fresh interpreter (``python -m forwardpass``, ``PYTHONPATH`` the
tree); the median is printed (``--json`` for a script). ``transcribe`` reads ``--clip`` (made with espeak-ng
when missing: "hello world", 22.05 kHz, so it is resampled too) with ``--speech-model`` (default tiny.en).
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
    ap.add_argument("--tree", type=Path, default=REPO, help="the checkout to run (default: this one)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--model", default=None, help="generate / chat / serve --model (default: the embedded)")
    ap.add_argument("--speech-model", default="tiny.en")
    ap.add_argument("--clip", type=Path, default=Path("/tmp/forwardpass-startup-clip.wav"))
    ap.add_argument("--commands", default="generate,chat,transcribe,serve")
    ap.add_argument("--warmup", action="store_true", help="run `forwardpass warmup` in --tree first")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    tree = args.tree.resolve()
    fp = [sys.executable, "-m", "forwardpass"]
    if args.warmup:
        subprocess.run([*fp, "warmup"], env=_env(tree), cwd=tree, check=True)
    if not args.clip.exists():
        if shutil.which("espeak-ng") is None:
            raise SystemExit(f"--clip {args.clip} is missing and espeak-ng is not installed to make it")
        subprocess.run(["espeak-ng", "-w", str(args.clip), "hello world"], check=True)
    model = ["--model", args.model] if args.model else []
    runs = {
        "generate": lambda: first_output([*fp, "generate", "Hi", "--max-tokens", "1", *model], tree, skip=2),
        "chat": lambda: first_output([*fp, "chat", "--max-tokens", "1", *model], tree, stdin=b"Hi\n"),
        "transcribe": lambda: first_output([*fp, "transcribe", str(args.clip), "--model", args.speech_model],
                                           tree),
        "serve": lambda: health_after([*fp, "serve", *model], tree),
    }
    figures: dict[str, object] = {"tree": str(tree), "load_before": os.getloadavg()[0],
                                  "cores": len(os.sched_getaffinity(0))}
    for name in args.commands.split(","):
        times = [runs[name]() for _ in range(args.repeat)]
        figures[name] = {"median_s": round(statistics.median(times), 2),
                         "runs_s": [round(t, 2) for t in times]}
    figures["heaviest_imports_ms"] = {k: round(v) for k, v in heaviest_imports(tree)}
    figures["load_after"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(figures, indent=1))
        return
    print(f"{tree} ({figures['cores']} cores, load average {figures['load_before']:.1f} before, "
          f"{figures['load_after']:.1f} after)")
    for name in args.commands.split(","):
        f = figures[name]
        print(f"  {name:<11} {f['median_s']:6.2f} s  (runs: {', '.join(f'{t:.2f}' for t in f['runs_s'])})")
    print("  heaviest imports of generate (cumulative ms): "
          + ", ".join(f"{k} {v}" for k, v in figures["heaviest_imports_ms"].items()))


if __name__ == "__main__":
    main()
