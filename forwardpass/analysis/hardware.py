"""Accelerator spec table, plus ``this-machine`` measured by a short microbenchmark.

Every FLOP/s figure is **dense** (vendor datasheets print the 2:4-sparsity number first; the dense one is
half of it). ``flops`` holds the tensor-core / matrix peak per compute dtype; ``vector_flops`` the plain
FP32 (non-tensor) rate, which is what elementwise work (norms, softmax, activations) runs at.
Bandwidth and capacity are in bytes (decimal: 1 GB = 1e9 B, 1 TB/s = 1e12 B/s), as vendors quote them.

The ridge point (ops:byte ratio) is ``peak / bandwidth``: an operation with a higher arithmetic intensity
(FLOPs per byte moved) is compute-bound on that device, a lower one memory-bound.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forwardpass.analysis.dtypes import normalize_dtype
from forwardpass.errors import ConfigError

log = logging.getLogger(__name__)

T = 1e12
GB = 1e9

#: If a device has no matrix unit for a compute dtype, the work runs in the next one of these
#: (e.g. FP8 weights on an A100 are upcast and multiplied in BF16; everything on a CPU in FP32).
_FALLBACK = {
    "fp32": (),
    "bf16": ("fp16", "fp32"),
    "fp16": ("bf16", "fp32"),
    "fp8": ("bf16", "fp16", "fp32"),
    "int8": ("bf16", "fp16", "fp32"),
    "int4": ("int8", "bf16", "fp16", "fp32"),
}


@dataclass(frozen=True)
class Hardware:
    """One accelerator: peaks, bandwidth, capacity, and where the figures come from."""

    name: str
    label: str
    flops: dict[str, float]  # dense matrix peak FLOP/s by compute dtype
    vector_flops: float  # FP32 non-tensor FLOP/s (elementwise ops)
    bandwidth: float  # memory bytes/s
    capacity: float  # memory bytes
    source: str = ""
    measured_at: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def compute_dtype(self, dtype: str) -> str:
        """The dtype the matrix units actually run for ``dtype`` (after any fallback)."""
        dtype = normalize_dtype(dtype)
        for cand in (dtype, *_FALLBACK[dtype]):
            if self.flops.get(cand):
                return cand
        raise ConfigError(f"hardware {self.name!r} lists no matmul peak for {dtype}")

    def peak(self, dtype: str = "bf16") -> float:
        """Dense matmul peak FLOP/s for ``dtype`` (falling back as described in ``_FALLBACK``)."""
        return self.flops[self.compute_dtype(dtype)]

    def ridge(self, dtype: str = "bf16") -> float:
        """Ops:byte ratio (FLOP/byte) above which a matmul in ``dtype`` is compute-bound."""
        return self.peak(dtype) / self.bandwidth

    @property
    def vector_ridge(self) -> float:
        return self.vector_flops / self.bandwidth

    @property
    def default_dtype(self) -> str:
        """bf16 on accelerators; fp32 where there is no fast bf16 (this machine)."""
        return "bf16" if self.flops.get("bf16") else "fp32"

    def to_dict(self, dtype: str | None = None) -> dict[str, Any]:
        dtype = dtype or self.default_dtype
        return {
            "name": self.name,
            "label": self.label,
            "compute_dtype": self.compute_dtype(dtype),
            "peak_flops": self.peak(dtype),
            "vector_flops": self.vector_flops,
            "bandwidth": self.bandwidth,
            "capacity": self.capacity,
            "ridge": self.ridge(dtype),
            "source": self.source,
            "measured_at": self.measured_at,
        }


# --------------------------------------------------------------------------------------------------
# Spec table. Sources are the vendors' datasheets; "x/2" means the sheet prints the sparse figure.
# --------------------------------------------------------------------------------------------------
SPECS: dict[str, Hardware] = {
    # NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM column): BF16/FP16 312 TFLOPS dense,
    # INT8 624 TOPS dense, FP32 19.5 TFLOPS, 80 GB HBM2e at 2,039 GB/s. No FP8 tensor cores.
    "a100": Hardware(
        name="a100",
        label="NVIDIA A100-80GB SXM",
        flops={"bf16": 312 * T, "fp16": 312 * T, "int8": 624 * T, "fp32": 19.5 * T},
        vector_flops=19.5 * T,
        bandwidth=2039 * GB,
        capacity=80 * GB,
        source="NVIDIA A100 datasheet (80GB SXM): 312 TF bf16 dense, 2039 GB/s, 80 GB",
    ),
    # NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column): BF16 1,979 TFLOPS sparse → 989.4 dense,
    # FP8 3,958 sparse → 1,979 dense, INT8 3,958 TOPS sparse → 1,979 dense, FP32 67 TFLOPS,
    # 80 GB HBM3 at 3.35 TB/s.
    "h100": Hardware(
        name="h100",
        label="NVIDIA H100 SXM",
        flops={"bf16": 989.4 * T, "fp16": 989.4 * T, "fp8": 1979 * T, "int8": 1979 * T, "fp32": 67 * T},
        vector_flops=67 * T,
        bandwidth=3350 * GB,
        capacity=80 * GB,
        source="NVIDIA H100 datasheet (SXM): 989 TF bf16 / 1979 TF fp8 dense, 3.35 TB/s, 80 GB",
    ),
    # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): same compute as H100 SXM (BF16 1,979 sparse →
    # 989 dense, FP8 3,958 sparse → 1,979 dense), FP32 67 TFLOPS, 141 GB HBM3e at 4.8 TB/s.
    "h200": Hardware(
        name="h200",
        label="NVIDIA H200 SXM",
        flops={"bf16": 989.4 * T, "fp16": 989.4 * T, "fp8": 1979 * T, "int8": 1979 * T, "fp32": 67 * T},
        vector_flops=67 * T,
        bandwidth=4800 * GB,
        capacity=141 * GB,
        source="NVIDIA H200 datasheet (SXM): 989 TF bf16 / 1979 TF fp8 dense, 4.8 TB/s, 141 GB",
    ),
    # NVIDIA HGX B200 datasheet, 8-GPU totals divided by 8: BF16 36 PF sparse → 2.25 PF dense per GPU,
    # FP8 72 PF sparse → 4.5 PF dense, INT8 72 POPS sparse → 4.5 dense, FP32 600 TF → 75 TF,
    # 1.44 TB HBM3e → 180 GB, 64 TB/s → 8 TB/s.
    "b200": Hardware(
        name="b200",
        label="NVIDIA B200 (HGX)",
        flops={"bf16": 2250 * T, "fp16": 2250 * T, "fp8": 4500 * T, "int8": 4500 * T, "fp32": 75 * T},
        vector_flops=75 * T,
        bandwidth=8000 * GB,
        capacity=180 * GB,
        source="NVIDIA HGX B200 datasheet /8: 2.25 PF bf16 / 4.5 PF fp8 dense, 8 TB/s, 180 GB",
    ),
    # NVIDIA L4 datasheet: BF16 242 TFLOPS sparse → 121 dense, FP8 485 sparse → 242.5 dense,
    # INT8 485 TOPS sparse → 242.5 dense, FP32 30.3 TFLOPS, 24 GB GDDR6 at 300 GB/s.
    "l4": Hardware(
        name="l4",
        label="NVIDIA L4",
        flops={"bf16": 121 * T, "fp16": 121 * T, "fp8": 242.5 * T, "int8": 242.5 * T, "fp32": 30.3 * T},
        vector_flops=30.3 * T,
        bandwidth=300 * GB,
        capacity=24 * GB,
        source="NVIDIA L4 datasheet: 121 TF bf16 / 242.5 TF fp8 dense, 300 GB/s, 24 GB",
    ),
    # NVIDIA L40S datasheet: BF16 733 TFLOPS sparse → 362.05 dense, FP8 1,466 sparse → 733 dense,
    # INT8 1,466 TOPS sparse → 733 dense, FP32 91.6 TFLOPS, 48 GB GDDR6 at 864 GB/s.
    "l40s": Hardware(
        name="l40s",
        label="NVIDIA L40S",
        flops={"bf16": 362.05 * T, "fp16": 362.05 * T, "fp8": 733 * T, "int8": 733 * T, "fp32": 91.6 * T},
        vector_flops=91.6 * T,
        bandwidth=864 * GB,
        capacity=48 * GB,
        source="NVIDIA L40S datasheet: 362 TF bf16 / 733 TF fp8 dense, 864 GB/s, 48 GB",
    ),
    # AMD Instinct MI300X datasheet: BF16/FP16 1,307.4 TFLOPS dense (2,614.9 sparse), FP8 2,614.9 dense,
    # INT8 2,614.9 TOPS dense, FP32 vector 163.4 TFLOPS, 192 GB HBM3 at 5.3 TB/s.
    "mi300x": Hardware(
        name="mi300x",
        label="AMD Instinct MI300X",
        flops={
            "bf16": 1307.4 * T,
            "fp16": 1307.4 * T,
            "fp8": 2614.9 * T,
            "int8": 2614.9 * T,
            "fp32": 163.4 * T,
        },
        vector_flops=163.4 * T,
        bandwidth=5300 * GB,
        capacity=192 * GB,
        source="AMD Instinct MI300X datasheet: 1307 TF bf16 / 2615 TF fp8 dense, 5.3 TB/s, 192 GB",
    ),
}

THIS_MACHINE = "this-machine"

ALIASES = {
    "a100-80gb": "a100",
    "a100-80gb-sxm": "a100",
    "a100-sxm": "a100",
    "h100-sxm": "h100",
    "h100-sxm5": "h100",
    "h200-sxm": "h200",
    "l40-s": "l40s",
    "mi300": "mi300x",
    "cpu": THIS_MACHINE,
    "local": THIS_MACHINE,
    "this": THIS_MACHINE,
    "this_machine": THIS_MACHINE,
}


def known_hardware() -> list[str]:
    return [*SPECS, THIS_MACHINE]


def get_hardware(name: str | Hardware, *, remeasure: bool = False) -> Hardware:
    """Look up a spec by name (``h100``, ``a100-80gb-sxm``, ``this-machine``, ...).

    ``this-machine`` is read from the cache file (:func:`cache_path`) or measured once and cached;
    ``remeasure=True`` measures again.
    """
    if isinstance(name, Hardware):
        return name
    key = str(name).strip().lower()
    key = ALIASES.get(key, key)
    if key in SPECS:
        return SPECS[key]
    if key == THIS_MACHINE:
        return this_machine(remeasure=remeasure)
    raise ConfigError(f"unknown hardware {name!r}; known: {', '.join(known_hardware())}", param="hardware")


# --------------------------------------------------------------------------------------------------
# this-machine: measured, cached
# --------------------------------------------------------------------------------------------------
def cache_path() -> Path:
    """``$XDG_CACHE_HOME/forwardpass/hardware.json`` (default ``~/.cache/forwardpass/hardware.json``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "forwardpass" / "hardware.json"


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _ram_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return 0.0


def _load_average() -> float | None:
    """1-minute load average while measuring: above the core count, the figures are understated."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):  # pragma: no cover
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def hardware_from_measurement(data: dict[str, Any]) -> Hardware:
    """Build the ``this-machine`` entry from a measurement record (as cached on disk)."""
    f = float(data["fp32_matmul_flops"])
    return Hardware(
        name=THIS_MACHINE,
        label=f"this machine ({data.get('cpu', 'cpu')}, {data.get('cores', '?')} cores)",
        flops={"fp32": f},
        vector_flops=f,
        bandwidth=float(data["read_bandwidth"]),
        capacity=float(data.get("capacity") or _ram_bytes()),
        source=(
            f"measured {data.get('measured_at', '?')}: {data.get('method', 'microbenchmark')}"
            + (f", load average {data['load_average']}" if data.get("load_average") is not None else "")
        ),
        measured_at=data.get("measured_at"),
        extra=dict(data),
    )


def best_time(fn: Any, n: int) -> float:
    """Shortest of ``n`` timed calls of ``fn``."""
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _read_bandwidth(read_mib: int, cores: int, repeats: int) -> tuple[float, float]:
    """Bytes/s reading a ``read_mib`` MiB fp32 buffer: torch.sum (all threads), NumPy max per core slice.

    The buffer sits on 2 MB pages, as the engine's weights and KV cache do (``huge_pages.py``; both
    follow ``FORWARDPASS_HUGE_PAGES``): that is the memory decode reads, and on 4 KB pages the same loop read
    ~15% slower on a Zen 4 VM (TLB misses, prefetchers stopping at page boundaries), so the engine's decode
    read faster than its "roof".
    """
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    import torch

    from forwardpass import huge_pages

    shape = (read_mib * 1024 * 1024 // 4,)
    x = huge_pages.empty_on_huge_pages(shape, torch.float32) if huge_pages.enabled() else torch.empty(shape)
    x.fill_(1.0)
    nbytes = x.numel() * 4
    x.sum()  # fault the pages in
    bw_torch = nbytes / best_time(x.sum, repeats)
    chunks = np.array_split(x.numpy(), cores)
    with ThreadPoolExecutor(cores) as pool:
        bw_numpy = nbytes / best_time(lambda: list(pool.map(np.max, chunks)), repeats)
    return bw_torch, bw_numpy


def measure_this_machine(*, read_mib: int = 512, matmul_n: int = 2048, repeats: int = 8) -> dict[str, Any]:
    """Microbenchmark this machine (about 3–10 s): best-of-N read bandwidth and fp32 matmul FLOP/s.

    Bandwidth: ``torch.sum`` over a ``read_mib`` MiB fp32 tensor (far larger than any L3) with torch using
    every core, and NumPy ``max`` over per-core slices in a thread pool; the best pass of either counts.
    Compute: two ``matmul_n``² fp32 matrices multiplied by ``torch.matmul`` (MKL) and by oneDNN's linear
    (what the engine's prefill uses; ~1.5× MKL's rate on an AMD Zen 4 pair), best of N of either.
    """
    import torch

    cores = _cores()
    old_threads = torch.get_num_threads()
    torch.set_num_threads(cores)
    try:
        bw_torch, bw_numpy = _read_bandwidth(read_mib, cores, repeats)
        a = torch.randn(matmul_n, matmul_n)
        b = torch.randn(matmul_n, matmul_n)
        tries = [lambda: a @ b]
        if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
            tries.append(lambda: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], ""))
        flops = 0.0
        for matmul in tries:
            matmul()  # warm up
            flops = max(flops, 2 * matmul_n**3 / best_time(matmul, max(3, repeats // 2)))
    finally:
        torch.set_num_threads(old_threads)
    return {
        "read_bandwidth": max(bw_torch, bw_numpy),
        "read_bandwidth_torch_sum": bw_torch,
        "read_bandwidth_numpy_threads": bw_numpy,
        "fp32_matmul_flops": flops,
        "capacity": _ram_bytes(),
        "cores": cores,
        "cpu": _cpu_name(),
        "torch": torch.__version__,
        "measured_at": _dt.datetime.now().isoformat(timespec="seconds"),
        "load_average": _load_average(),
        "method": (
            f"read {read_mib} MiB fp32 with {cores} threads (torch.sum / numpy), "
            f"fp32 matmul {matmul_n}^3, best of {repeats}"
        ),
    }


def this_machine(*, remeasure: bool = False, path: Path | None = None) -> Hardware:
    """The measured ``this-machine`` entry, from the cache unless missing, stale or ``remeasure``."""
    path = path or cache_path()
    if not remeasure and path.is_file():
        try:
            cached = json.loads(path.read_text()).get(THIS_MACHINE)
            if cached and int(cached.get("cores", -1)) == _cores():
                return hardware_from_measurement(cached)
        except (ValueError, OSError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable hardware cache %s: %s", path, exc)
    log.info("measuring this machine (read bandwidth, fp32 matmul); cached in %s", path)
    data = measure_this_machine()
    load = data.get("load_average")
    if load is not None and load > data["cores"]:
        log.warning(
            "load average %.1f exceeds %d cores while measuring: figures are likely low; "
            "re-run with --remeasure when the machine is idle",
            load,
            data["cores"],
        )
    save_measurement(data, path)
    return hardware_from_measurement(data)


def save_measurement(data: dict[str, Any], path: Path | None = None) -> Path:
    path = path or cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        doc = json.loads(path.read_text()) if path.is_file() else {}
        if not isinstance(doc, dict):
            doc = {}
    except (ValueError, OSError):
        doc = {}
    doc[THIS_MACHINE] = data
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    tmp.replace(path)
    return path


