"""``forwardpass warmup``: build, now, the C++ kernels this machine's execution plans use.

Each kernel is compiled once per machine (and source version) into torch's extension cache; without this
command the first run that needs one compiles it while you wait (30-80 s, named on the status line).
Which builds a plan takes depends on the CPU's flags (``forwardpass/kernel_build.py``: an AVX-512 or AVX2
build, AMX where the CPU has it), so this command asks the same functions the plan does.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
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
    """The builds this machine's plans load, in ``groups``; the same objects the engine loads through."""
    from forwardpass.attention import cpu_kernel
    from forwardpass.kernel_build import cpu_flags
    from forwardpass.layers import small_matmul
    from forwardpass.quant import kernel as quant

    out = []
    if "decode" in groups:
        out += [Build("decode", cpu_kernel.KERNEL, cpu_kernel.LOADER),
                Build("decode", small_matmul.KERNEL, small_matmul.LOADER)]
    if "quant" in groups:
        out.append(Build("quant", quant.KERNEL, quant.LOADER))
    if "kblock" in groups:
        out.append(Build("kblock", quant.KBLOCK_KERNEL, quant.KBLOCK_LOADER))
    if "amx" in groups and quant.gemm_path(cpu_flags()) == "amx":
        out.append(Build("amx", quant.AMX_KERNEL, quant.AMX_LOADER))
    return out


def run(args: argparse.Namespace) -> int:
    import json
    import logging
    import time

    from forwardpass.errors import ValidationError

    groups = [g.strip() for g in args.kernels.split(",") if g.strip()]
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown or not groups:
        raise ValidationError(f"--kernels {args.kernels!r}: choose from {', '.join(GROUPS)}", param="kernels")
    builds = planned_builds(groups)
    if args.json:  # the output is the JSON object alone
        logging.getLogger("forwardpass").setLevel(logging.ERROR)
    results = []
    for i, b in enumerate(builds, 1):
        head = f"[{i}/{len(builds)}] {b.what}"
        start = time.perf_counter()
        if not b.loader.pending and b.loader.module is None and not b.loader.failed:
            outcome = f"switched off ({b.loader.switch}=0)"
        else:
            was_built = b.kernel.is_built()
            ok = b.loader.load() is not None  # built (its wait named) and imported, as an engine does
            outcome = ("already built" if was_built else "built") if ok else f"failed: {b.loader.fallback}"
        seconds = time.perf_counter() - start
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
