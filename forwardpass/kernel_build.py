"""Building the C++ kernels (torch ``cpp_extension``): one place for what every kernel needs.

* **A name per source and flags**: the build folder is
  ``NAME_<hash of the source, its headers, flags and path>``, so a changed kernel or flag never reuses (or
  silently re-versions) an old build, and "is it built?" is one file check.
* **Shared headers in one place**: a header that kernels of two folders include lives in
  ``forwardpass/csrc/`` (:data:`SHARED_CSRC`); each kernel names the headers it includes (``headers=``), and
  their folders are its include path, so a source includes ``"transpose16.h"``, never a path up and across.
* **Portable flags**: exactly the instruction sets the intrinsics need (``-mavx2 -mfma``), never
  ``-march=native``: the build cache outlives the host (a VM moves, a home folder is shared), and code
  for a newer CPU would die with an illegal instruction on an older one.
* **A stale lock is cleared**: torch waits for ever on the ``lock`` file of a build that was killed;
  a lock older than any real build is removed, with a log line.
* **A visible wait**: the kernel named on the command's status line with the elapsed time
  (``forwardpass/progress.py``); one log line elsewhere.
* **Loaded once** (:class:`KernelLoader`): built and imported on first use, kept for the process; a kernel
  that cannot be built is said once in the log and its caller's fallback path is used from then on.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forwardpass import envs

#: the C++ headers shared by kernels of different folders (``layers/csrc``, ``quant/csrc``)
SHARED_CSRC = Path(__file__).with_name("csrc")
#: what every kernel includes instead of ``torch/extension.h`` (whose C++ frontend was two thirds of a
#: kernel's compile time): each names it in its ``headers=``
TORCH_EXT = SHARED_CSRC / "torch_ext.h"
#: flags an AVX2-only CPU (AMD Zen 2/3, Intel before Skylake-SP) lacks: what
#: ``FORWARDPASS_CPU_ISA=avx2`` hides
WIDER_THAN_AVX2 = ("avx512", "amx")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The host CPU's feature flags (Linux ``/proc/cpuinfo``; empty elsewhere, which selects the AVX2 build).

    ``FORWARDPASS_CPU_ISA=avx2`` reports an AVX2-only CPU (every ``avx512*`` and ``amx*`` flag dropped), so
    that every kernel choice made from the flags (builds, GEMM paths, row thresholds) is the one an AMD Zen 3
    would make: how the suite is run on an AVX-512 or AMX host for the machines CI may land on."""
    flags: frozenset[str] = frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = frozenset(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    if envs.get("FORWARDPASS_CPU_ISA") == "avx2":
        flags = frozenset(f for f in flags if not f.startswith(WIDER_THAN_AVX2))
    return flags


def pick_isa(forced_by: str, wide: str, wide_needs: set[str], flags: frozenset[str]) -> str:
    """Which build of a kernel to use: ``wide`` (an AVX-512 build) where ``flags`` (the CPU's) include every
    flag it is compiled for, else ``"avx2"``; the environment variable ``forced_by`` (registered in
    ``forwardpass/envs.py``) set to either wins."""
    forced = envs.get(forced_by)
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
    # seconds of one quiet core to compile it (g++ -O3; measured on a busy 2-core Zen 3 from the CPU time of
    # a cold `forwardpass warmup`): what warmup's estimate and the status line say
    expected_s: int = 30
    # the headers the source includes (its own folder's and SHARED_CSRC's): part of the build's name too, and
    # their folders its include path
    headers: tuple[Path, ...] = ()

    @property
    def include_paths(self) -> list[str]:
        """The folders of the headers outside the source's own (which the compiler searches anyway)."""
        own = self.source.parent.resolve()
        return sorted({str(h.parent.resolve()) for h in self.headers} - {str(own)})

    @property
    def build_name(self) -> str:
        code = self.source.read_bytes() + b"".join(h.read_bytes() for h in self.headers)
        # the source's path too: the build files name it, so two checkouts sharing one cache folder would each
        # rebuild the other's build every time they alternate (a minute of compiling per switch)
        where = " ".join((str(self.source.resolve()), *self.include_paths))
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
            extra_include_paths=self.include_paths,
            verbose=False,
        )
        if self.is_built():
            return build()
        with compile_progress(self.what, self.expected_s, logger):
            return build()


class KernelLoader:
    """One compiled kernel of a process, loaded on first use: what every ``load_*_kernel`` function is.

    * ``load()`` builds (if needed) and imports ``kernel`` the first time, and returns that module from then
      on;
    * a failure (no compiler, a missing header, ``check`` refusing the module) is remembered and said once in
      the log, with ``fallback`` (what its caller does instead); ``load()`` returns None from then on, so a
      process never retries a failed build at every layer it quantizes or every engine it starts;
    * ``switch``: a bool knob of ``forwardpass/envs.py`` that turns the kernel off while it reads false; read
      at each call, so a process that has not loaded the kernel yet follows the environment of the moment;
    * ``check``: called with the freshly imported module before it is kept (the AMX kernel asks Linux for the
      tile state; the paged-decode kernel loads its companion matmul): raising counts as a failure to load.
    """

    def __init__(self, kernel: CppKernel, fallback: str, logger: logging.Logger, *, switch: str | None = None,
                 check: Callable[[Any], object] | None = None) -> None:  # fmt: skip
        self.kernel, self.fallback, self.logger = kernel, fallback, logger
        self.switch, self.check = switch, check
        self.module: Any = None
        self.failed = False

    @property
    def pending(self) -> bool:
        """Whether ``load()`` would try to load: not loaded yet, not failed, not switched off."""
        return self.module is None and not self.failed and (self.switch is None or envs.get(self.switch))

    def load(self, ready: Callable[[], bool] | None = None) -> Any:
        """The module, or None (failed, switched off). ``ready`` is asked first, when a load would be tried:
        False returns None for now, without loading (how a caller waits on a build run elsewhere)."""
        if not self.pending:
            return self.module
        try:
            if ready is not None and not ready():
                return None
            module = self.kernel.load(self.logger)
            if self.check is not None:
                self.check(module)
        except Exception as exc:  # noqa: BLE001 - compiler or headers missing, no AVX2, ...: fall back, loudly
            self.failed = True
            self.logger.warning("%s unavailable (%s); %s", self.kernel.what, exc, self.fallback)
            return None
        self.module = module
        return module


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
    """The wait named on the command's one status line (``forwardpass/progress.py``: a spinner that is
    already drawn, "loading ...", is retitled rather than overwritten), or one log line off a terminal."""
    from forwardpass import progress

    with progress.step(f"compiling {what} (once, ~{expected_s} s; cached afterwards)", logger):
        yield
    logger.info("compiled %s", what)
