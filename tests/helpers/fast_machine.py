"""A hardware cache for a machine so fast (1 PFLOP/s, 10 TB/s, 1 us per step) that every real step takes
far more than 3x its prediction: the oversubscription judge and the dashboard's regimes have a known
answer."""

from __future__ import annotations

import json
from pathlib import Path

from torch.utils.cpp_extension import _get_build_directory

FAST_MACHINE = {"this-machine": {"fp32_matmul_flops": 1e15, "read_bandwidth": 1e13, "cores": 2, "cpu": "t"},
                "overhead-cpu": {"per_step_s": 1e-6, "per_layer_s": 0.0}}


def fast_machine_env(cache_dir: Path) -> dict[str, str]:
    """Environment for a child process whose hardware cache (under ``cache_dir``) is FAST_MACHINE's; the
    kernels already built stay where they are (no rebuild under the new cache folder)."""
    (cache_dir / "forwardpass").mkdir(parents=True, exist_ok=True)
    (cache_dir / "forwardpass" / "hardware.json").write_text(json.dumps(FAST_MACHINE))
    kernels = str(Path(_get_build_directory("x", verbose=False)).parent)
    return {"XDG_CACHE_HOME": str(cache_dir), "TORCH_EXTENSIONS_DIR": kernels}
