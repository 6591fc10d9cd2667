"""``--lora NAME=PATH`` for the ``generate`` and ``serve`` commands.

``requests = parse_lora_specs(args.lora)`` gives ``{name: LoRARequest}`` (ids 1, 2, ... in the order
given); ``lora_engine_kwargs(requests)`` gives the ``EngineConfig`` / ``LLM`` keyword arguments
(``enable_lora``, ``max_loras``, ``max_lora_rank``) sized for them. Each name is then a model
name in ``/v1/models``; a request whose ``model`` is that name runs with ``requests[name]``.
"""

from __future__ import annotations

import argparse

from forwardpass.lora.errors import LoRAAdapterError
from forwardpass.lora.request import LoRARequest  # both torch-free: `serve` can import this module cheaply


def add_lora_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="serve a PEFT LoRA adapter directory under NAME (repeatable)")
    p.add_argument("--max-lora-rank", type=int, default=None,
                   help="largest adapter rank the engine accepts (default: the largest given)")


def parse_lora_specs(specs: list[str] | None) -> dict[str, LoRARequest]:
    """``["name=path", ...]`` → ``{name: LoRARequest(name, i, path)}``; clear errors on bad specs."""
    out: dict[str, LoRARequest] = {}
    for i, spec in enumerate(specs or [], start=1):
        name, sep, path = spec.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise LoRAAdapterError(f"--lora expects NAME=PATH, got {spec!r}", param="lora")
        if name in out:
            raise LoRAAdapterError(f"--lora name {name!r} is given twice", param="lora")
        out[name] = LoRARequest(name, i, path)
    return out


def lora_engine_kwargs(requests: dict[str, LoRARequest], max_lora_rank: int | None = None,
                       max_loras: int | None = None) -> dict:
    """Engine keyword arguments that fit ``requests`` (empty when there are none)."""
    if not requests:
        return {}
    from forwardpass.lora.adapter import adapter_rank

    rank = max_lora_rank or max(adapter_rank(r.lora_path) for r in requests.values())
    return {"enable_lora": True, "max_loras": max_loras or len(requests), "max_lora_rank": int(rank)}
