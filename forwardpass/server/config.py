"""ServerConfig: HTTP-side settings (the engine's live in EngineConfig / EngineSpec)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from forwardpass.lora.request import LoRARequest

#: Request caps (also in the OpenAPI schema, so clients and fuzzers see them).
MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 8
MAX_STOP_LENGTH = 256
MAX_PROMPTS = 32  # prompts in one /v1/completions batch


@dataclass
class ServerConfig:
    #: served model name -> adapter (``None`` = the base model). The first name is the default; the
    #: LoRA work can add ``NAME -> LoRARequest`` entries here, which the routes pass to the engine.
    models: dict[str, LoRARequest | None] = field(default_factory=lambda: {"forwardpass": None})
    api_key: str | None = None
    max_request_bytes: int = 4 << 20  # 413 above this
    retry_after_s: int = 1  # Retry-After sent with 503 when the waiting queue is full
    enable_debug_endpoints: bool = False  # GET /debug/engine (free blocks, invariants) for tests
    shutdown_timeout_s: float = 30.0

    @property
    def default_model(self) -> str:
        return next(iter(self.models))
