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
MAX_SEQS_PER_REQUEST = 64  # n x prompts: the sequences one request may add to the engine
MAX_MESSAGES = 1024  # chat messages in one request


@dataclass
class ServerConfig:
    #: served model name -> adapter (``None`` = the base model). The first name is the default; the
    #: LoRA work can add ``NAME -> LoRARequest`` entries here, which the routes pass to the engine.
    models: dict[str, LoRARequest | None] = field(default_factory=lambda: {"forwardpass": None})
    api_key: str | None = None
    max_request_bytes: int = 4 << 20  # 413 above this
    # a request's work in tokens: (prompt + max_tokens) summed over its n x prompts sequences (400 above)
    max_request_tokens: int = 1 << 20
    retry_after_s: int = 1  # Retry-After sent with 503 when the waiting queue is full
    # --engine-restarts: a dead engine is restarted this many times (backoff between), then the server exits
    # non-zero (engine/frontend/supervisor.py, server/run.py)
    engine_restarts: int = 3
    # --max-memory: refuse a model whose weights + KV cache need more (forwardpass/memory_need.py); None:
    # the memory available (cgroup limit, MemAvailable, ulimit -v)
    max_memory_bytes: int | None = None
    enable_debug_endpoints: bool = False  # GET /debug/engine (free blocks, invariants) for tests
    enable_tokenizer_info: bool = False  # GET /tokenizer_info (vLLM's; it publishes the chat template)
    shutdown_timeout_s: float = 30.0  # on SIGTERM: then every stream still open ends with an error + [DONE]
    request_timeout_s: float | None = None  # a request running longer fails (504 / an SSE error event)
    watchdog_timeout_s: float = 60.0  # /health is 503 when the engine has work but no progress this long
    read_timeout_s: float = 30.0  # a request body not fully received in this time gets a 408
    template_time_limit_s: float = 2.0  # chat-template render time limit (400 above)
    template_max_chars: int = 8 << 20  # chat-template output-size limit (400 above)
    text_workers: int = 2  # threads for tokenization, detokenization and templates
    # CORS (llama.cpp's habit); empty: no CORS headers
    allowed_origins: list[str] = field(default_factory=list)
    # /v1/responses: responses kept in memory for previous_response_id (the most recent; 0 keeps none)
    responses_max_stored: int = 256
    reasoning_parser: str | None = None  # "qwen3" | "deepseek_r1": <think>...</think> -> reasoning_content
    # Diffusion routes, only when asked: a pipeline folder or "default" (the embedded model, loaded at the
    # first request); None: no route. /v1/images/generations and /v1/videos
    # (server/images.py, server/videos.py).
    image_model: str | None = None
    video_model: str | None = None
    # vLLM's serve flags of the same names
    root_path: str = ""  # --root-path: routes answer under this prefix too (behind a proxy that keeps it)
    force_include_usage: bool = False  # --enable-force-include-usage: usage on every streamed chunk
    max_logprobs: int = MAX_LOGPROBS  # --max-logprobs: top logprobs a request may ask for; -1: vocabulary
    return_tokens_as_token_ids: bool = False  # --return-tokens-as-token-ids: the default of the field

    @property
    def default_model(self) -> str:
        return next(iter(self.models))
