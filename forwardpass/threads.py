"""How many CPU threads this process computes with: one count, resolved once, used by every entry point.

torch's own default is the machine's core count, which ignores what this process may actually use: a CPU
affinity mask (``taskset``, a container's ``--cpuset-cpus``) or a cgroup CPU quota (``--cpus 2`` on a 64-core
host). More compute threads than usable cores make every parallel region wait for a descheduled thread;
the issue that added this module measured 5-27x slower decode on a shared 2-core machine. So:

* :func:`usable_cores` is the affinity mask's size capped by the cgroup quota (v2 ``cpu.max``, v1
  ``cpu.cfs_quota_us``), at least 1;
* :func:`apply_threads` sets torch's intra-op pool to the requested count (``--threads N``,
  ``LLM(num_threads=N)``, ``ImagePipeline(num_threads=N)``) or, when none is given, to the default chosen
  once for the process (the usable cores). The compiled kernels (``forwardpass/quant``, ``layers/csrc``,
  ``attention/csrc``) parallelise with ``at::parallel_for``, which runs on that same pool, so one call sets
  both; torch's inter-op pool is sized once, to the same count.

``OMP_WAIT_POLICY``: set at ``import forwardpass`` (``forwardpass.set_openmp_wait``), before torch loads.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from forwardpass.errors import ValidationError

_CGROUP_V2 = Path("/sys/fs/cgroup/cpu.max")
_CGROUP_V1 = Path("/sys/fs/cgroup/cpu")

_chosen: list[int] = []  # the count this process computes with, once one is applied
_explicit: list[int] = []  # counts asked for by name (--threads N, num_threads=N), not defaulted


def affinity_cores() -> int:
    """CPUs this process may be scheduled on (its affinity mask; the machine's count where there is none)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def cgroup_quota_cores(root: Path | None = None) -> float | None:
    """The cgroup CPU quota in cores (``cpu.max`` ``200000 100000`` -> 2.0); None: unlimited or unknown."""
    v2 = (root / "cpu.max") if root is not None else _CGROUP_V2
    try:
        quota, period = v2.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    v1 = root if root is not None else _CGROUP_V1
    try:
        quota_us = int((v1 / "cpu.cfs_quota_us").read_text())
        period_us = int((v1 / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def usable_cores() -> int:
    """Cores this process can keep busy: the affinity mask, capped by the cgroup quota (rounded up: a quota
    of 1.5 cores still runs two threads part of the time), at least 1."""
    cores = affinity_cores()
    quota = cgroup_quota_cores()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return cores


def default_threads() -> int:
    """The count a command or API uses when given none: the usable cores (``usable_cores``)."""
    return usable_cores()


def check_threads(n: int | None, param: str = "threads") -> int | None:
    """``n`` itself when it is a valid count (or None); else a ``ValidationError`` naming ``param``."""
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValidationError(f"{param} must be a positive integer (a count of threads), got {n!r}",
                              param=param)
    return n


def resolve_threads(n: int | None = None) -> int:
    """``n`` if given, else the count already applied in this process, else :func:`default_threads`."""
    check_threads(n)
    if n is not None:
        return n
    return _chosen[-1] if _chosen else default_threads()


def apply_threads(n: int | None = None) -> int:
    """Make torch's pools (and so the compiled kernels) compute with ``n`` threads, or the process's default
    when ``n`` is None; returns the count. Cheap to call again (``torch.set_num_threads`` only)."""
    import torch

    count = resolve_threads(n)
    if n is None and not _chosen:  # the first default of the process: never above what torch was set to
        count = min(count, torch.get_num_threads())
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
    if not _chosen:
        try:  # settable once, before any inter-op work: a process that already ran some keeps torch's
            torch.set_num_interop_threads(count)
        except RuntimeError:
            pass
    _chosen[:] = [count]
    if n is not None:
        _explicit[:] = [n]
    return count


@contextlib.contextmanager
def using_threads(n: int | None) -> Iterator[int]:
    """torch's pool (and so the compiled kernels) at ``n`` threads (None: the process's count) for the block,
    then back to what it was: a pipeline call does not change the count of the code around it."""
    import torch

    before = torch.get_num_threads()
    count = resolve_threads(n)
    torch.set_num_threads(count)
    try:
        yield count
    finally:
        torch.set_num_threads(before)


def with_own_threads(call: Callable) -> Callable:
    """Decorates a pipeline's ``__call__``: it runs under ``using_threads(self.thread_count())``."""
    @functools.wraps(call)
    def wrapper(self, *args, **kwargs):
        with using_threads(self.thread_count()):
            return call(self, *args, **kwargs)

    return wrapper


def applied_threads() -> int | None:
    """The count last applied through :func:`apply_threads` in this process, or None."""
    return _chosen[-1] if _chosen else None


#: Below this many parameters a network's per-call work is a few milliseconds of small matmuls, and a second
#: thread costs more in synchronisation than it saves (the embedded image and video denoisers: docs/cli.md)
SMALL_MODEL_PARAMS = 20_000_000


def small_model_threads(module) -> int | None:
    """The count a model's caller should use when given none: the one asked for by name earlier in this
    process (``--threads N``), else 1 for a module under :data:`SMALL_MODEL_PARAMS` parameters, else None
    (the process's default)."""
    if _explicit:
        return _explicit[-1]
    params = sum(p.numel() for p in module.parameters())
    return 1 if params < SMALL_MODEL_PARAMS else None
