"""``forwardpass serve``: the OpenAI-compatible HTTP server (FastAPI + uvicorn)."""

from __future__ import annotations

import argparse

from forwardpass.commands._common import add_model_args, add_quantization_arg

DEFAULT_MAX_NUM_SEQS = 64
#: a Whisper window keeps its encoder's cross-attention states (~18 MB for tiny.en) in the KV budget, so 64 of
#: them would not fit the default 1 GiB; a server of several models batches this many speech windows
SPEECH_MAX_NUM_SEQS = 8


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("model_tag", nargs="*", default=[], metavar="MODEL",
                   help="the model, as vLLM takes it (`forwardpass serve smollm2`); same as --model. Several "
                   "models: one server for all, each loaded when a request names it (the first is the "
                   "default; docs/serving.md, 'Several models')")
    p.add_argument("--models-max", type=int, default=None, metavar="N",
                   help="several models: at most N loaded at once, the least recently used unloaded first "
                   "(default: all)")
    p.add_argument("--models-memory", type=float, default=None, metavar="GB",
                   help="several models: the memory the loaded models may take (weights + KV cache, "
                   "estimated); least recently used ones are unloaded to make room, and a model that "
                   "cannot fit alone is refused with a 503")
    add_model_args(p)
    add_quantization_arg(p)
    p.add_argument("--task", choices=["auto", "generate", "embed"], default="auto",
                   help="generate (completions, chat) or embed (/v1/embeddings); auto: embed for encoder "
                        "models")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the name clients send as 'model' "
                   "(default: the model directory's name; forwardpass-default for the embedded model)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (not on /health, /metrics); "
                   "prefer the FORWARDPASS_API_KEY environment variable (a flag is visible in ps)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help=f"sequences in one forward pass at most (default {DEFAULT_MAX_NUM_SEQS}; with "
                   f"several models, {SPEECH_MAX_NUM_SEQS} for a speech model, whose windows each hold their "
                   "encoder's states in the KV budget)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="per-step token budget (prompt chunks + decode tokens; default 512: a prompt chunk "
                        "of at most this many tokens shares a step with the decoding sequences, so a wave of "
                        "new requests gets its first tokens one chunk at a time; docs/serving.md)")
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
    p.add_argument("--threads", "--num-threads", dest="threads", type=int, default=None, metavar="N",
                   help="CPU threads of the engine (torch's pools and the compiled kernels; default: the "
                        "cores this process may use); use 1 on small, shared machines")
    p.add_argument("--max-request-bytes", type=int, default=4 << 20, help="413 for larger request bodies")
    p.add_argument("--max-request-tokens", type=int, default=1 << 20,
                   help="400 for a request whose (prompt + max_tokens) x n over its prompts is larger")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests get to finish (then: an error event and "
                        "[DONE])")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="fail a request that has not finished after this many seconds (default: no limit)")
    p.add_argument("--watchdog-timeout", type=float, default=60.0,
                   help="/health answers 503 when the engine has work but made no progress for this many "
                        "seconds")
    p.add_argument("--read-timeout", type=float, default=30.0,
                   help="a request body not fully received within this many seconds gets a 408")
    p.add_argument("--chat-template-timeout", type=float, default=2.0,
                   help="render time limit of the chat template per request (a 400 above it)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model across this many processes (ranks: gloo on CPU, NCCL on GPU); each "
                   "holds 1/N of the weights and of the KV cache. Under torchrun: the world size (see "
                   "docs/distributed.md)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models: whole experts per rank instead of every expert split across the ranks")
    p.add_argument("--distributed-timeout", type=float, default=60.0,
                   help="seconds a collective between ranks may wait before the engine fails (a hung rank)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="run this many engine replicas behind the one API; each request goes to the least "
                        "loaded")
    p.add_argument("--engine-backend", choices=["process", "thread"], default="process",
                   help="run the engine loop in its own process (default) or in a thread of the server")
    p.add_argument("--max-memory", type=float, default=None, metavar="GIB",
                   help="refuse to start when the model's weights + KV cache need more than this many GiB "
                        "(default: the memory available: the cgroup limit, MemAvailable or ulimit -v, "
                        "whichever is smallest; checked either way)")
    p.add_argument("--engine-restarts", type=int, default=3, metavar="N",
                   help="restart an engine that dies (killed by the OS, crashed) up to N times, with a "
                        "backoff of 1, 2, 4, ... s (at most 30 s); then the server exits with status 1 "
                        "(0: exit at the first death)")
    from forwardpass.lora.cli import add_lora_args  # light: no torch

    add_lora_args(p)  # --lora NAME=PATH (repeatable), --max-lora-rank
    p.add_argument("--no-access-log", action="store_true", help="do not log one line per HTTP request")
    p.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between throughput / KV-cache lines while the engine is busy (0: never)")
    p.add_argument("--enable-debug-endpoints", action="store_true", help="GET /debug/engine (for tests)")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="GET /tokenizer_info: the tokenizer's configuration and chat template (vLLM's)")
    p.add_argument("--reasoning-parser", choices=["qwen3", "deepseek_r1"], default=None,
                   help="split <think>...</think> into reasoning_content (chat responses and stream deltas)")
    p.add_argument("--image-model", default=None, metavar="DIR|default",
                   help="also serve POST /v1/images/generations with this diffusion pipeline folder "
                   "('default': the embedded digits model); loaded at the first request")  # fmt: skip
    p.add_argument("--video-model", default=None, metavar="DIR|default",
                   help="also serve /v1/videos jobs with this video pipeline folder ('default': the embedded "
                   "moving-digits model); loaded at the first request")  # fmt: skip
    p.add_argument("--allowed-origins", nargs="*", default=[],
                   help="CORS: origins browsers may call the API from ('*' for any); preflights need no API "
                        "key")
    from forwardpass.server.serve_flags import add_vllm_flags

    add_vllm_flags(p)  # --root-path, --max-logprobs, --enable-force-include-usage, ...
    # MODULE:NAME of an LLMEngine subclass to build instead (tests inject faults with it).
    p.add_argument("--engine-factory", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def _one_model(positional: str | None, flag: str | None) -> str | None:
    """``serve MODEL`` (vLLM's form) or ``serve --model MODEL``; both naming different models is an error."""
    from forwardpass.errors import ValidationError

    if positional is not None and flag is not None and positional != flag:
        raise ValidationError(f"two models given: {positional!r} (positional) and --model {flag!r}; give "
                              "one, as `forwardpass serve MODEL` or `forwardpass serve --model MODEL`",
                              param="model")
    return flag if flag is not None else positional


def run(args: argparse.Namespace) -> int:
    import logging
    from pathlib import Path

    from forwardpass.commands._common import check_device, resolve_model
    from forwardpass.commands.serve_log import (
        ThroughputLogger,
        check_model,
        reserve_port,
        serve_logger,
        startup_errors_one_line,
    )
    from forwardpass.config import EngineConfig
    from forwardpass.distributed.executor import torchrun_world
    from forwardpass.engine.frontend.async_engine import EngineSpec
    from forwardpass.errors import ModelNotFoundError, ValidationError

    # Everything a user can get wrong is checked here, in this order, before the model loads: the address
    # (a busy port is found in a second, not after a minute of loading), the device, the engine options,
    # then the model directory and its architecture. Each failure is one line and exit code 1.
    from forwardpass.registry import require_name
    from forwardpass.server.run import run_server

    if len(args.model_tag) > 1:  # several models behind one server: commands/serve_multi.py
        from forwardpass.commands.serve_multi import run_multi

        return run_multi(args)
    for flag, value in (("--models-max", args.models_max), ("--models-memory", args.models_memory)):
        if value is not None:
            raise ValidationError(f"{flag} applies to a server of several models (forwardpass serve MODEL "
                                  "MODEL ...)", param=flag)
    positional = args.model_tag[0] if args.model_tag else None
    args.model = require_name(_one_model(positional, args.model))  # "" is an error, before anything
    torchrun = torchrun_world()
    worker = torchrun is not None and torchrun[0] != 0  # torchrun rank > 0: no HTTP, a shard of the model
    sock = None if worker else reserve_port(args.host, args.port)
    device = check_device(args.device)
    model = resolve_model(args.model, args.revision)
    if not (Path(model) / "config.json").is_file():
        raise ModelNotFoundError(f"{model} is not a model directory (no config.json)"
                                 + ("; the embedded default model is not built yet"
                                    if not args.model else ""))
    from forwardpass.embed.task import resolve_task

    if resolve_task(model, args.task) == "embed":  # an encoder: its own small app, no generation engine
        from forwardpass.commands.serve_embed import run_embed

        return run_embed(args, model, sock, device)
    config_kwargs = engine_config_kwargs(args, device)
    if worker:  # computes the steps rank 0's engine broadcasts, until rank 0 stops
        from forwardpass.distributed.worker import torchrun_worker_main

        torchrun_worker_main(str(model), EngineConfig(**config_kwargs))
        return 0
    from forwardpass.registry import served_name

    name = args.served_model_name or served_name(args.model, Path(model))  # an HF id: that id, as vLLM
    # Served names -> adapter (None = the base model); the routes pass a name's adapter to the engine.
    models: dict = {name: None}
    if args.lora:
        from forwardpass.lora.cli import lora_engine_kwargs, parse_lora_specs

        loras = parse_lora_specs(args.lora)
        if name in loras:
            raise ValidationError(f"--lora name {name!r} is the base model's served name", param="lora")
        models.update(loras)
        config_kwargs.update(lora_engine_kwargs(loras, args.max_lora_rank))
    from forwardpass import envs

    check_server_flags(args)
    engine_config = EngineConfig(**config_kwargs)  # validates the engine options (e.g. --max-num-seqs 0)
    from forwardpass.server.diffusion_service import resolve_folder

    resolve_folder(args.image_model, "image"), resolve_folder(args.video_model, "video")  # before loading
    spec_info = check_model(model, engine_config)  # unsupported architectures and bad configs, before loading
    api_key = args.api_key or envs.get("FORWARDPASS_API_KEY")
    server_config = build_server_config(args, models, api_key)
    from forwardpass.memory_need import check_memory

    # weights + KV cache against the memory there is, before loading: refused in one line, not OOM-killed
    check_memory(model, engine_config, server_config.max_memory_bytes)
    level = logging.getLogger().getEffectiveLevel()
    factory = engine_factory(args)
    spec = EngineSpec(model=str(model), config_kwargs=config_kwargs, factory=factory, log_level=level,
                      num_threads=args.threads)
    log = serve_logger(args.log_level)
    log.info("loading %s (%s) on %s ...", name, spec_info["architecture"], device)
    throughput = ThroughputLogger(log, args.log_stats_interval)

    def started(engine) -> None:
        spec_info.update(engine_config=engine_config, engine=engine, host=args.host,
                         port=sock.getsockname()[1], name=name, api_key=bool(api_key), threads=args.threads)
        from forwardpass.commands.serve_log import banner

        for line in banner(spec_info):
            log.info("%s", line)
        from forwardpass.analysis.oversubscription import OversubscriptionWatch

        dtype = {"bfloat16": "bf16", "float16": "fp16"}.get(spec_info["dtype"], "fp32")
        throughput.watch = OversubscriptionWatch(spec_info["spec"].layers, dtype, device=device.split(":")[0])
        throughput.attach(engine)

    with startup_errors_one_line():
        try:
            run_server(spec, server_config, host=args.host, port=args.port, backend=args.engine_backend,
                       max_queued_requests=args.max_queued_requests,
                       log_level="info" if level > logging.DEBUG else "debug", sockets=[sock],
                       on_started=started, access_log=not args.no_access_log,
                       data_parallel_size=args.data_parallel_size)
        except SystemExit as exc:  # uvicorn exits 3 when the app's start-up (loading the engine) failed
            if exc.code in (0, None):
                raise
            from forwardpass.errors import ForwardpassError

            raise ForwardpassError("the engine failed to start (its error is logged above)") from None
        finally:
            throughput.stop()
    return 0


def engine_config_kwargs(args: argparse.Namespace, device: str) -> dict:
    """The ``EngineConfig`` keyword arguments of the engine flags (every model of a server shares them)."""
    return {
        "dtype": args.dtype, "device": device, "max_model_len": args.max_model_len,
        "max_num_seqs": DEFAULT_MAX_NUM_SEQS if args.max_num_seqs is None else args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "fair_share_tokens": args.fair_share_tokens, "max_stats_records": args.max_stats_records,
        "num_kv_blocks": args.num_kv_blocks, "kv_cache_memory": args.kv_cache_memory,
        "block_size": args.block_size, "enable_prefix_caching": not args.no_prefix_caching, "seed": args.seed,
        "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
        "batch_invariant": args.batch_invariant,
        "speculative_config": args.speculative_config,
        "tensor_parallel_size": args.tensor_parallel_size,
        "enable_expert_parallel": args.enable_expert_parallel,
        "distributed_timeout_s": args.distributed_timeout,
    }


def check_server_flags(args: argparse.Namespace) -> None:
    """The HTTP side's numbers: one line naming the flag for a value that cannot work."""
    from forwardpass.errors import ValidationError

    for flag, value in (("--request-timeout", args.request_timeout),
                        ("--watchdog-timeout", args.watchdog_timeout), ("--read-timeout", args.read_timeout),
                        ("--chat-template-timeout", args.chat_template_timeout),
                        ("--shutdown-timeout", args.shutdown_timeout)):
        if value is not None and not value > 0:
            raise ValidationError(f"{flag} must be a positive number of seconds, got {value}", param=flag)
    for flag, count in (("--max-request-bytes", args.max_request_bytes),
                        ("--max-request-tokens", args.max_request_tokens)):
        if count < 1:
            raise ValidationError(f"{flag} must be a positive integer, got {count}", param=flag)
    if args.max_memory is not None and not args.max_memory > 0:
        raise ValidationError(f"--max-memory must be a positive number of GiB, got {args.max_memory}",
                              param="--max-memory")
    if args.engine_restarts < 0:
        raise ValidationError(f"--engine-restarts must be >= 0, got {args.engine_restarts}",
                              param="--engine-restarts")
    if args.data_parallel_size < 1:
        raise ValidationError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}",
                              param="--data-parallel-size")


def build_server_config(args: argparse.Namespace, models: dict, api_key: str | None):
    """The ``ServerConfig`` of the flags; ``models``: served name -> adapter (None: a base model)."""
    from forwardpass.server.config import ServerConfig
    from forwardpass.server.serve_flags import vllm_flag_settings

    return ServerConfig(models=models, api_key=api_key, max_request_bytes=args.max_request_bytes,
                        max_request_tokens=args.max_request_tokens,
                        enable_debug_endpoints=args.enable_debug_endpoints,
                        enable_tokenizer_info=args.enable_tokenizer_info_endpoint,
                        shutdown_timeout_s=args.shutdown_timeout,
                        request_timeout_s=args.request_timeout,
                        watchdog_timeout_s=args.watchdog_timeout, read_timeout_s=args.read_timeout,
                        template_time_limit_s=args.chat_template_timeout,
                        reasoning_parser=args.reasoning_parser,
                        allowed_origins=list(args.allowed_origins), image_model=args.image_model,
                        video_model=args.video_model, engine_restarts=args.engine_restarts,
                        max_memory_bytes=None if args.max_memory is None else int(args.max_memory * 2**30),
                        **vllm_flag_settings(args))


def engine_factory(args: argparse.Namespace):
    """``--engine-factory MODULE:NAME``: the engine class tests inject faults with, or None."""
    if not args.engine_factory:
        return None
    import importlib

    module, _, attr = args.engine_factory.partition(":")
    return getattr(importlib.import_module(module), attr)
