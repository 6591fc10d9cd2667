"""``forwardpass serve A B C``: several models behind one server (``server/multi_app.py``), each loaded when a
request names it, under ``--models-max`` and ``--models-memory``.

Every model is checked here before the server listens (its name, its files, its architecture, its kind), so
a typo is a one-line start-up error, not a 500 at the first request. The engine flags (``--max-num-seqs``,
``--kv-cache-memory``, ...) apply to each generation engine, and each model keeps its own KV cache.
"""

from __future__ import annotations

import argparse
import functools
import logging
from pathlib import Path

from forwardpass.errors import ValidationError

GB = 1e9


def _refuse_single_model_flags(args: argparse.Namespace) -> None:
    """Flags whose meaning is one model's: refused, not guessed, when there are several."""
    several = "with several models (each is served under the name `forwardpass models` prints, or its path's)"
    if args.model is not None:
        raise ValidationError(f"--model and several positional models: list every model as a positional "
                              f"argument (forwardpass serve MODEL MODEL ...), got --model {args.model}",
                              param="model")
    if args.served_model_name:
        raise ValidationError(f"--served-model-name names one model; it does not apply {several}",
                              param="--served-model-name")
    if args.lora:
        raise ValidationError("--lora adapters belong to one base model; serve them on a server of that one "
                              "model (forwardpass serve MODEL --lora NAME=PATH)", param="--lora")
    if args.task != "auto":
        raise ValidationError(f"--task {args.task}: with several models each one's task is its kind "
                              "(generate, transcribe, embed, image, video), found from its files; leave "
                              "--task out", param="--task")
    for flag, value in (("--data-parallel-size", args.data_parallel_size),
                        ("--tensor-parallel-size", args.tensor_parallel_size)):
        if value != 1:
            raise ValidationError(f"{flag} {value}: one engine per model {several}; run a separate server "
                                  "for a model that needs several ranks or replicas", param=flag)
    if args.models_max is not None and args.models_max < 1:
        raise ValidationError(f"--models-max must be >= 1, got {args.models_max}", param="--models-max")
    if args.models_memory is not None and not args.models_memory > 0:
        raise ValidationError(f"--models-memory must be a positive number of GB, got {args.models_memory}",
                              param="--models-memory")


def _model_kind(model_dir: Path, embedded: str | None):
    """The kind of the model at ``model_dir`` (``embedded``: the registry's kind of an embedded name)."""
    import json

    from forwardpass.server.model_pool import ModelKind

    if embedded in ("image", "video"):
        return ModelKind(embedded)
    index = model_dir / "model_index.json"
    if index.is_file():  # a diffusion pipeline folder: a video one names a video pipeline class
        cls = str(json.loads(index.read_text()).get("_class_name", ""))
        return ModelKind.VIDEO if "video" in cls.lower() else ModelKind.IMAGE
    from forwardpass.loader.config import load_model_config
    from forwardpass.models.registry import is_embedding_architecture

    arch = load_model_config(model_dir).architecture or ""
    if is_embedding_architecture(arch):
        return ModelKind.EMBED
    return ModelKind.TRANSCRIBE if arch.startswith("Whisper") else ModelKind.GENERATE


def run_multi(args: argparse.Namespace) -> int:
    from forwardpass import envs
    from forwardpass.commands._common import check_device
    from forwardpass.commands.serve import (
        SPEECH_MAX_NUM_SEQS,
        build_server_config,
        check_server_flags,
        engine_config_kwargs,
        engine_factory,
    )
    from forwardpass.commands.serve_log import (
        check_model,
        reserve_port,
        serve_logger,
        startup_errors_one_line,
    )
    from forwardpass.config import EngineConfig
    from forwardpass.distributed.executor import torchrun_world
    from forwardpass.engine.frontend.async_engine import EngineSpec
    from forwardpass.errors import ModelNotFoundError
    from forwardpass.memory_need import model_memory_need, weight_file_bytes
    from forwardpass.registry import embedded_kind, embedded_path, packaged_path, require_name, resolve_model
    from forwardpass.registry import served_name as served_name_of
    from forwardpass.server.model_loaders import (
        EngineSettings,
        load_diffusion_model,
        load_encoder_model,
        load_engine_model,
        model_server_config,
    )
    from forwardpass.server.model_pool import ModelKind, ModelPool, ModelSlot
    from forwardpass.server.multi_app import run_multi_server

    _refuse_single_model_flags(args)
    if torchrun_world() is not None:
        raise ValidationError("several models are served by one process each; torchrun is for one model",
                              param="model")
    given = [str(require_name(m)) for m in args.model_tag]
    sock = reserve_port(args.host, args.port)  # a busy port fails in a second, before any model is read
    device = check_device(args.device)
    check_server_flags(args)
    config_kwargs = engine_config_kwargs(args, device)
    engine_config = EngineConfig(**config_kwargs)  # validates the engine options once, for every model
    api_key = args.api_key or envs.get("FORWARDPASS_API_KEY")
    level = logging.getLogger().getEffectiveLevel()
    settings = EngineSettings(backend=args.engine_backend, max_queued_requests=args.max_queued_requests)
    factory = engine_factory(args)
    plans: list[tuple[str, ModelKind, Path, Path]] = []  # (name, kind, model dir, where its weights are)
    for text in given:
        embedded = embedded_kind(text)
        if embedded in ("image", "video"):
            model_dir = embedded_path(text)
        else:
            model_dir = resolve_model(text, args.revision)
            if not ((model_dir / "config.json").is_file() or (model_dir / "model_index.json").is_file()):
                raise ModelNotFoundError(f"{text}: {model_dir} is not a model directory (no config.json)",
                                         param="model")
        source = packaged_path(text) or (Path(text).expanduser() if Path(text).expanduser().exists()
                                         else model_dir)
        plans.append((served_name_of(text, model_dir), _model_kind(model_dir, embedded), model_dir, source))
    for _flag, value, kind in (("--image-model", args.image_model, ModelKind.IMAGE),
                               ("--video-model", args.video_model, ModelKind.VIDEO)):
        from forwardpass.registry import diffusion_served_name
        from forwardpass.server.diffusion_service import resolve_folder

        folder = resolve_folder(value, kind.value)
        if folder is not None:
            plans.append((str(diffusion_served_name(value, kind.value)), kind, Path(folder), Path(folder)))
    names = [p[0] for p in plans]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValidationError(f"two models would be served under the same name {', '.join(twice)}; serve "
                              "each model once", param="model")
    server_config = build_server_config(args, dict.fromkeys(names), api_key)
    slots = []
    for name, kind, model_dir, source in plans:
        own = model_server_config(server_config, name)
        if kind in (ModelKind.GENERATE, ModelKind.TRANSCRIBE):
            check_model(str(model_dir), engine_config)  # unsupported architectures, before loading
            kwargs = config_kwargs
            if kind is ModelKind.TRANSCRIBE and args.max_num_seqs is None:
                kwargs = {**config_kwargs, "max_num_seqs": SPEECH_MAX_NUM_SEQS}
            spec = EngineSpec(model=str(model_dir), config_kwargs=kwargs, factory=factory,
                              log_level=level, num_threads=args.threads)
            load = functools.partial(load_engine_model, spec, own, settings)
            # the same estimate a one-model server checks before loading (memory_need.py)
            memory = model_memory_need(model_dir, EngineConfig(**kwargs)).total_bytes
        elif kind is ModelKind.EMBED:
            load = functools.partial(load_encoder_model, str(model_dir), own, dtype=args.dtype, device=device,
                                     max_model_len=args.max_model_len,
                                     max_num_batched_tokens=args.max_num_batched_tokens)
            memory = weight_file_bytes(source)
        else:
            load = functools.partial(load_diffusion_model, str(model_dir), kind.value, own)
            memory = weight_file_bytes(source)
        slots.append(ModelSlot(name, kind, memory, load))
    budget = None if args.models_memory is None else int(args.models_memory * GB)
    first = slots[0]
    if budget is not None and first.memory_bytes > budget:
        raise ValidationError(f"the default model {first.name} needs about {first.memory_bytes / GB:.2f} GB, "
                              f"more than --models-memory {args.models_memory:g} GB", param="--models-memory")
    log = serve_logger(args.log_level)
    for slot in slots:
        over = budget is not None and slot.memory_bytes > budget
        log.info("model %s: %s, about %.2f GB%s", slot.name, slot.kind, slot.memory_bytes / GB,
                 " (over --models-memory: requests for it get a 503)" if over else "")
    if any(s.kind is ModelKind.EMBED for s in slots):
        from forwardpass.threads import apply_threads

        apply_threads(args.threads)  # encoders compute in this process (as `serve --task embed` does)
    pool = ModelPool(slots, max_loaded=args.models_max, memory_budget_bytes=budget,
                     load_timeout_s=args.request_timeout, unload_timeout_s=args.shutdown_timeout)

    def started() -> None:
        import forwardpass

        url = f"http://{args.host}:{sock.getsockname()[1]}"
        log.info("forwardpass %s serving %d models at %s/v1 (default %s; at most %s loaded%s; API key "
                 "%s): %s",
                 forwardpass.__version__, len(slots), url, slots[0].name, args.models_max or len(slots),
                 "" if budget is None else f", within {args.models_memory:g} GB",
                 "required" if api_key else "not required", pool.described())

    with startup_errors_one_line():
        try:
            run_multi_server(pool, server_config, host=args.host, sockets=[sock],
                             log_level="info" if level > logging.DEBUG else "debug",
                             access_log=not args.no_access_log, on_started=started)
        except SystemExit as exc:  # uvicorn exits 3 when the app's start-up (the default model) failed
            if exc.code in (0, None):
                raise
            from forwardpass.errors import ForwardpassError

            raise ForwardpassError("the default model failed to load (its error is logged above)") from None
    return 0
