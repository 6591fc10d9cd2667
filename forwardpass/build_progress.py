"""A visible wait for one-time compilation (C++ kernels): a spinner, a pulsing bar and the elapsed
time on a terminal; one log line elsewhere (logs, CI, pipes). Compilers run in subprocesses, so the
display's refresh thread keeps moving while the build blocks the calling thread."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def compile_progress(what: str, expected_s: int, logger: logging.Logger) -> Iterator[None]:
    message = f"compiling {what} (once, ~{expected_s} s; cached afterwards)"
    if not sys.stderr.isatty():
        logger.warning(message)
        yield
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        progress.add_task(message, total=None)  # total unknown: the bar pulses
        yield
    logger.info("compiled %s", what)
