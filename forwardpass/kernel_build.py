"""Building the C++ kernels (torch ``cpp_extension``): one place for what every kernel needs.

* **A name per source and flags**: the build folder is ``NAME_<hash of the source, its headers, flags and path>``, so a
  changed kernel or flag never reuses (or silently re-versions) an old build, and "is it built?" is one
  file check.
* **Portable flags**: exactly the instruction sets the intrinsics need (``-mavx2 -mfma``), never
  ``-march=native``: the build cache outlives the host (a VM moves, a home folder is shared), and code
  for a newer CPU would die with an illegal instruction on an older one.
* **A stale lock is cleared**: torch waits for ever on the ``lock`` file of a build that was killed;
  a lock older than any real build is removed, with a log line.
* **A visible wait**: a spinner, a pulsing bar and the elapsed time on a terminal; one log line elsewhere.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: flags an AVX2-only CPU (AMD Zen 2/3, Intel before Skylake-SP) lacks: what ``FORWARDPASS_CPU_ISA=avx2`` hides
WIDER_THAN_AVX2 = ("avx512", "amx")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The host CPU's feature flags (Linux ``/proc/cpuinfo``; empty elsewhere, which selects the AVX2 build).

    ``FORWARDPASS_CPU_ISA=avx2`` reports an AVX2-only CPU (every ``avx512*`` and ``amx*`` flag dropped), so that
    every kernel choice made from the flags (builds, GEMM paths, row thresholds) is the one an AMD Zen 3 would
    make: how the suite is run on an AVX-512 or AMX host for the machines CI may land on."""
    flags: frozenset[str] = frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = frozenset(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    if os.environ.get("FORWARDPASS_CPU_ISA") == "avx2":
        flags = frozenset(f for f in flags if not f.startswith(WIDER_THAN_AVX2))
    return flags


def pick_isa(forced_by: str, wide: str, wide_needs: set[str], flags: frozenset[str]) -> str:
    """Which build of a kernel to use: ``wide`` (an AVX-512 build) where ``flags`` (the CPU's) include every
    flag it is compiled for, else ``"avx2"``; the environment variable ``forced_by`` set to either wins."""
    forced = os.environ.get(forced_by)
    if forced in ("avx2", wide):
        return forced
    return wide if wide_needs <= flags else "avx2"


#: A build lock older than this belongs to a build that died (a real build takes well under a minute).
STALE_LOCK_S = 600.0


@dataclass(frozen=True)
class CppKernel:
    name: str  # the extension's base name
    source: Path
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...] = ()
    what: str = "a C++ kernel"  # for people: "the C++ paged-decode kernel"
    expected_s: int = 30
    headers: tuple[Path, ...] = ()  # local headers the source includes: part of the build's name too

    @property
    def build_name(self) -> str:
        code = self.source.read_bytes() + b"".join(h.read_bytes() for h in self.headers)
        # the source's path too: the build files name it, so two checkouts sharing one cache folder would each
        # rebuild the other's build every time they alternate (a minute of compiling per switch)
        where = str(self.source.resolve())
        digest = hashlib.sha256(code + " ".join((*self.cflags, *self.ldflags, where)).encode())
        return f"{self.name}_{digest.hexdigest()[:10]}"

    def build_dir(self) -> Path:
        from torch.utils.cpp_extension import _get_build_directory

        return Path(_get_build_directory(self.build_name, verbose=False))

    def is_built(self) -> bool:
        return (self.build_dir() / f"{self.build_name}.so").exists()

    def load(self, logger: logging.Logger) -> Any:
        """Build if needed (showing the wait) and import the module; raises if it cannot be built."""
        from torch.utils.cpp_extension import load

        _clear_stale_lock(self.build_dir() / "lock", logger)
        build = lambda: load(
            name=self.build_name,
            sources=[str(self.source)],
            extra_cflags=list(self.cflags),
            extra_ldflags=list(self.ldflags),
            verbose=False,
        )
        if self.is_built():
            return build()
        with compile_progress(self.what, self.expected_s, logger):
            return build()


def _clear_stale_lock(lock: Path, logger: logging.Logger) -> None:
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        logger.warning("removing a stale kernel build lock (%s, %.0f s old: its build died)", lock, age)
        lock.unlink(missing_ok=True)


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
