"""``forwardpass serve --task embed``: an encoder model behind ``/v1/embeddings``
(``server/embedding_app.py``)."""

from __future__ import annotations

import argparse
import logging
import socket
from pathlib import Path

from forwardpass import envs


def run_embed(args: argparse.Namespace, model: str, sock: socket.socket, device: str) -> int:
    from forwardpass.commands.serve_log import serve_logger
    from forwardpass.errors import ValidationError
    from forwardpass.server.config import ServerConfig
    from forwardpass.server.embedding_app import run_embedding_server

    # Flags of the generation engine mean nothing to an encoder: say so instead of ignoring them.
    for flag, value in (
        ("--lora", args.lora),
        ("--reasoning-parser", args.reasoning_parser),
        ("--quantization", getattr(args, "quantization", None)),
        ("--kv-cache-dtype",
         None if getattr(args, "kv_cache_dtype", "auto") == "auto" else args.kv_cache_dtype),
        ("--batch-invariant", getattr(args, "batch_invariant", False)),
    ):
        if value:
            raise ValidationError(f"{flag} does not apply to an embedding model (--task embed)", param=flag)
    from forwardpass.registry import served_name

    # a packaged model by its name (all-minilm-l6-v2), a path by its last part, a Hugging Face id by that id
    name = args.served_model_name or served_name(args.model, Path(model))
    api_key = args.api_key or envs.get("FORWARDPASS_API_KEY")
    config = ServerConfig(
        models={name: None},
        api_key=api_key,
        max_request_bytes=args.max_request_bytes,
        shutdown_timeout_s=args.shutdown_timeout,
        watchdog_timeout_s=args.watchdog_timeout,
        read_timeout_s=args.read_timeout,
        allowed_origins=list(args.allowed_origins),
    )
    log = serve_logger(args.log_level)
    from forwardpass.threads import apply_threads

    apply_threads(args.threads)  # resolved by the command (forwardpass/threads.py); this process computes

    def load():
        from forwardpass.embed.runner import EmbeddingRunner

        log.info("loading %s (embedding model) on %s ...", name, device)
        return EmbeddingRunner(
            model,
            dtype=args.dtype,
            device=device,
            max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )

    def started(embedder) -> None:
        r = embedder.runner
        log.info(
            "serving %s: %d-dim embeddings (%s), max_model_len %d, on http://%s:%d/v1/embeddings",
            name,
            r.dimensions,
            r.pooling.source,
            r.limits.max_model_len,
            args.host,
            sock.getsockname()[1],
        )

    level = logging.getLogger().getEffectiveLevel()
    run_embedding_server(
        load,
        config,
        host=args.host,
        sockets=[sock],
        log_level="info" if level > logging.DEBUG else "debug",
        access_log=not args.no_access_log,
        on_started=started,
    )
    return 0
