"""One status line per process on the terminal: what a command is waiting for, by name, with elapsed time.

A command shows a spinner while it loads (``status("loading smollm2")``); whatever it waits for inside that
— a kernel compile, a GGUF conversion — says so on the same line (``step("compiling the C++ Q4 kernel
(first run, ~40 s)")``) instead of starting a second live display that would overwrite the first. When
the inner wait ends the line goes back to the outer message; the outer one ends with a "done in" line.
Off a terminal nothing is drawn: :func:`step` logs its message once (a log file should still say why a
start took a minute).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_shown: list[tuple[Any, Any]] = []  # (rich Progress, its task id) of the status line drawn now


def active() -> bool:
    """Whether a status line is drawn in this process now."""
    return bool(_shown)


@contextmanager
def status(message: str, *, done_line: bool = True) -> Iterator[None]:
    """A spinner with ``message`` and the elapsed time on stderr (a terminal only), then ``message: done in
    N s`` when it took a second or more. Nested inside another status, it retitles that one."""
    if not sys.stderr.isatty():
        yield
        return
    if _shown:
        with _retitled(message):
            yield
        return
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    start = time.perf_counter()
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                  transient=True) as bar:
        _shown.append((bar, bar.add_task(f"{message}...", total=None)))
        try:
            yield
        finally:
            _shown.pop()
    elapsed = time.perf_counter() - start
    if done_line and elapsed >= 1.0:
        console.print(f"[dim]{message}: done in {elapsed:.1f} s[/dim]", highlight=False)


@contextmanager
def step(message: str, logger: logging.Logger | None = None) -> Iterator[None]:
    """What the process waits for now: on the status line drawn (or a new one), else one log line."""
    if not sys.stderr.isatty():
        (logger or logging.getLogger("forwardpass")).warning("%s", message)
        yield
        return
    with status(message, done_line=False):
        yield


@contextmanager
def _retitled(message: str) -> Iterator[None]:
    bar, task = _shown[-1]
    before = next(t.description for t in bar.tasks if t.id == task)
    bar.update(task, description=f"{message}...")
    try:
        yield
    finally:
        bar.update(task, description=before)
