"""``forwardpass serve``: the OpenAI-compatible HTTP server (FastAPI + uvicorn)."""

from __future__ import annotations

import argparse

from forwardpass.commands._common import add_model_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_model_args(p)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the name clients send as 'model' "
                   "(default: the model directory's name; forwardpass-default for the embedded model)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (not on /health, /metrics); "
                   "prefer the FORWARDPASS_API_KEY environment variable (a flag is visible in ps)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences in one forward pass at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="per-step token budget")
    p.add_argument("--fair-share-tokens", type=int, default=32,
                   help="with every batch slot taken, a newcomer swaps out a stream that generated this many "
                   "tokens (it resumes later, from the prefix cache); 0 disables")
    p.add_argument("--max-queued-requests", type=int, default=1024,
                   help="requests waiting for their first token at most; more get 503 + Retry-After")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV-cache size in blocks")
    p.add_argument("--max-stats-records", type=int, default=10_000,
                   help="per-step records the engine keeps for /metrics and the dashboard (~2 KB each)")
    p.add_argument("--kv-cache-memory", type=int, default=None, help="KV-cache size in bytes (default 1 GiB)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch compute threads of the engine (default: torch's; use 1 on small, shared machines)")
    p.add_argument("--max-request-bytes", type=int, default=4 << 20, help="413 for larger request bodies")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests get to finish (then: an error event and [DONE])")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="fail a request that has not finished after this many seconds (default: no limit)")
    p.add_argument("--watchdog-timeout", type=float, default=60.0,
                   help="/health answers 503 when the engine has work but made no progress for this many seconds")
    p.add_argument("--read-timeout", type=float, default=30.0,
                   help="a request body not fully received within this many seconds gets a 408")
    p.add_argument("--chat-template-timeout", type=float, default=2.0,
                   help="render time limit of the chat template per request (a 400 above it)")
    p.add_argument("--engine-backend", choices=["process", "thread"], default="process",
                   help="run the engine loop in its own process (default) or in a thread of the server")
    from forwardpass.lora.cli import add_lora_args  # light: no torch

    add_lora_args(p)  # --lora NAME=PATH (repeatable), --max-lora-rank
    p.add_argument("--enable-debug-endpoints", action="store_true", help="GET /debug/engine (for tests)")
    # MODULE:NAME of an LLMEngine subclass to build instead (tests inject faults with it).
    p.add_argument("--engine-factory", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import logging
    from pathlib import Path

    from forwardpass.commands._common import resolve_model
    from forwardpass.engine.async_engine import EngineSpec
    from forwardpass.errors import ModelNotFoundError, ValidationError
    from forwardpass.server.config import ServerConfig
    from forwardpass.server.run import run_server

    model = resolve_model(args.model)
    if not (Path(model) / "config.json").is_file():
        raise ModelNotFoundError(f"{model} is not a model directory (no config.json)"
                                 + ("; the embedded default model is not built yet" if not args.model else ""))
    config_kwargs = {
        "dtype": args.dtype, "device": args.device, "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "fair_share_tokens": args.fair_share_tokens, "max_stats_records": args.max_stats_records, "num_kv_blocks": args.num_kv_blocks,
        "kv_cache_memory": args.kv_cache_memory, "block_size": args.block_size,
        "enable_prefix_caching": not args.no_prefix_caching, "seed": args.seed,
    }
    name = args.served_model_name or (Path(model).resolve().name if args.model else "forwardpass-default")
    # Served names -> adapter (None = the base model); the routes pass a name's adapter to the engine.
    models: dict = {name: None}
    if args.lora:
        from forwardpass.lora.cli import lora_engine_kwargs, parse_lora_specs

        loras = parse_lora_specs(args.lora)
        if name in loras:
            raise ValidationError(f"--lora name {name!r} is the base model's served name", param="lora")
        models.update(loras)
        config_kwargs.update(lora_engine_kwargs(loras, args.max_lora_rank))
    import os

    for flag, value in (("--request-timeout", args.request_timeout), ("--watchdog-timeout", args.watchdog_timeout),
                        ("--read-timeout", args.read_timeout), ("--chat-template-timeout", args.chat_template_timeout),
                        ("--shutdown-timeout", args.shutdown_timeout)):
        if value is not None and not value > 0:
            raise ValidationError(f"{flag} must be a positive number of seconds, got {value}", param=flag)
    api_key = args.api_key or os.environ.get("FORWARDPASS_API_KEY") or None
    server_config = ServerConfig(models=models, api_key=api_key, max_request_bytes=args.max_request_bytes,
                                 enable_debug_endpoints=args.enable_debug_endpoints,
                                 shutdown_timeout_s=args.shutdown_timeout, request_timeout_s=args.request_timeout,
                                 watchdog_timeout_s=args.watchdog_timeout, read_timeout_s=args.read_timeout,
                                 template_time_limit_s=args.chat_template_timeout)
    level = logging.getLogger().getEffectiveLevel()
    factory = None
    if args.engine_factory:
        import importlib

        module, _, attr = args.engine_factory.partition(":")
        factory = getattr(importlib.import_module(module), attr)
    spec = EngineSpec(model=str(model), config_kwargs=config_kwargs, factory=factory, log_level=level,
                      num_threads=args.num_threads)
    run_server(spec, server_config, host=args.host, port=args.port, backend=args.engine_backend,
               max_queued_requests=args.max_queued_requests,
               log_level="info" if level > logging.DEBUG else "debug")
    return 0
