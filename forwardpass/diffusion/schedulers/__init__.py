"""Schedulers by class name, as ``scheduler_config.json`` names them in ``_class_name``.

Short aliases (``flow_match``/``euler``, ``ddim``, ``lcm``) are accepted for the CLI.
"""

from __future__ import annotations

from typing import Any

from forwardpass.diffusion.schedulers.base import Scheduler, SchedulerOutput
from forwardpass.diffusion.schedulers.ddim import DDIMScheduler
from forwardpass.diffusion.schedulers.flow_match import FlowMatchEulerDiscreteScheduler
from forwardpass.diffusion.schedulers.lcm import LCMScheduler
from forwardpass.errors import ConfigError

SCHEDULERS: dict[str, type[Scheduler]] = {
    "FlowMatchEulerDiscreteScheduler": FlowMatchEulerDiscreteScheduler,
    "DDIMScheduler": DDIMScheduler,
    "LCMScheduler": LCMScheduler,
}
ALIASES = {"flow_match": "FlowMatchEulerDiscreteScheduler", "euler": "FlowMatchEulerDiscreteScheduler",
           "ddim": "DDIMScheduler", "lcm": "LCMScheduler"}  # fmt: skip


def scheduler_class(name: str) -> type[Scheduler]:
    key = ALIASES.get(name.lower(), name) if isinstance(name, str) else name
    try:
        return SCHEDULERS[key]
    except (KeyError, TypeError):
        raise ConfigError(
            f"unknown scheduler {name!r}; choose one of {sorted(SCHEDULERS)} (or {sorted(ALIASES)})",
            param="scheduler",
        ) from None


def scheduler_from_config(config: dict[str, Any]) -> Scheduler:
    name = config.get("_class_name")
    if not name:
        raise ConfigError("scheduler config has no _class_name", param="scheduler")
    return scheduler_class(name).from_config(config)


__all__ = ["SCHEDULERS", "DDIMScheduler", "FlowMatchEulerDiscreteScheduler", "LCMScheduler", "Scheduler",
           "SchedulerOutput", "scheduler_class", "scheduler_from_config"]  # fmt: skip
