"""What ``forwardpass serve`` tells its operator: start-up checks that fail in one line, the banner, and the
periodic throughput / KV-cache line (vLLM's "Avg prompt throughput ..." log).

Kept apart from ``serve.py`` (the flags and the order of things) so each reads in one screen.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import logging
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from forwardpass.errors import ConfigError


# ----- before loading ---------------------------------------------------------------------------
def reserve_port(host: str, port: int) -> socket.socket:
    """Bind the listening socket now (uvicorn gets it later), so a busy or impossible address is an error
    in the first second rather than after the model has loaded."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port} is not a TCP port (0-65535)", param="port")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restarts reuse TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"port {port} on {host} is already in use (another server?); stop it or choose "
                              "another with --port", param="port") from None
        if exc.errno == errno.EACCES:
            raise ConfigError(f"no permission to listen on {host}:{port} (ports below 1024 need privileges); "
                              "choose another with --port", param="port") from None
        reason = exc.strerror or str(exc)
        raise ConfigError(f"cannot listen on {host}:{port}: {reason}; check --host", param="host") from None
    sock.set_inheritable(False)
    return sock


def spec_parameters(spec: Any) -> int:
    """Parameters of a model from its spec (the analyzer's accounting), for a GGUF file's banner."""
    from forwardpass.models.accounting import params

    return int(params(spec))


def count_parameters(model_dir: str | Path) -> int:
    """Parameters in the directory's safetensors files, from their headers alone (nothing is loaded)."""
    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, entry in header.items():
            if name != "__metadata__":
                size = 1
                for d in entry["shape"]:
                    size *= d
                total += size
    return total


def check_model(model_dir: str, engine_config: Any) -> dict[str, Any]:
    """Read the model's config as the engine will (an unsupported architecture or a bad field fails here,
    in one line) and return what the banner shows."""
    from forwardpass.errors import MissingFileError
    from forwardpass.loader.config import load_model_config
    from forwardpass.models.model_spec import ModelSpec, model_name
    from forwardpass.models.registry import resolve_model_class

    cfg = load_model_config(model_dir)
    if not cfg.architecture:
        raise MissingFileError(f"{Path(model_dir) / 'config.json'} has no 'architectures' entry naming the "
                               "model class")
    resolve_model_class(cfg.architecture)
    spec = ModelSpec.from_config(cfg, name=model_name(model_dir))
    from forwardpass.loader.ctranslate2 import is_converted_dir
    from forwardpass.loader.gguf import check_gguf_dir, is_gguf_dir
    from forwardpass.loader.weights import find_weight_files

    if is_gguf_dir(model_dir):  # a directory standing for a .gguf file: its weights are in that file
        check_gguf_dir(model_dir)
        params = spec_parameters(spec)
    elif is_converted_dir(model_dir):  # standing for a CTranslate2 model.bin (tiny.en): its weights are there
        params = spec_parameters(spec)
    else:
        find_weight_files(model_dir)  # no weights: one line now, not a traceback from the engine process
        params = count_parameters(model_dir)
    from forwardpass.engine.scheduling.checkpoint_defaults import with_checkpoint_defaults

    dtype = engine_config.torch_dtype
    kv_dtype = with_checkpoint_defaults(engine_config, model_dir).torch_kv_dtype
    return {"architecture": cfg.architecture, "spec": spec, "dtype": str(dtype).removeprefix("torch."),
            "params": params,
            "kv_bytes_per_token": spec.kv_bytes_per_token(kv_dtype.itemsize)}


# ----- once started -----------------------------------------------------------------------------
def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _count(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def banner(info: dict[str, Any]) -> list[str]:
    """The lines ``serve`` prints once the model is loaded and the port listens."""
    import forwardpass

    engine, cfg = info["engine"], info["engine_config"]
    einfo = engine.info
    host = info["host"]
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else shown}:{info['port']}"
    kv_tokens = einfo.num_blocks * einfo.block_size
    plan = einfo.execution_plan or {}
    computing, stored = plan.get("dtype", info["dtype"]), info["spec"].torch_dtype
    head = (f"forwardpass {forwardpass.__version__} serving {info['name']!r}: {info['architecture']}, "
            f"{_count(info['params'])} parameters, computing in {computing} on {cfg.device}"
            + (f" (a {stored} checkpoint)" if stored and stored != computing else ""))
    from forwardpass.commands.plan_text import plan_lines

    # weights per layer kind and what multiplies them, the kernels with their ISA, the threads
    weights_and_kernels = plan_lines({"kv_cache_dtype": info["dtype"], **plan}, info.get("threads") or 1)
    memory = (f"  context {einfo.max_model_len} tokens per sequence; KV cache {einfo.num_blocks} blocks x "
              f"{einfo.block_size} tokens = {kv_tokens:,} tokens "
              f"({_size(kv_tokens * info['kv_bytes_per_token'])}); batch up to {einfo.max_num_seqs} "
              f"sequences, {cfg.max_num_batched_tokens} tokens per step")
    api = (f"  OpenAI API  {url}/v1   (models: {', '.join(engine_model_names(info))}; "
           f"API key {'required' if info['api_key'] else 'not required'})")
    pages = (f"  chat page   {url}/      dashboard {url}/dashboard      metrics {url}/metrics      docs "
             f"{url}/docs")
    return [head, *weights_and_kernels, memory, api, pages]


def engine_model_names(info: dict[str, Any]) -> list[str]:
    return [info["name"]]


class ThroughputLogger:
    """Every ``interval_s`` while the engine works (and once when it goes idle), one line like vLLM's:
    prompt and generation tokens/s over the interval, running and waiting sequences, KV-cache use and
    the prefix-cache hit rate. Steps arrive on the event loop; a daemon thread writes the lines."""

    def __init__(self, log: logging.Logger, interval_s: float) -> None:
        self.log, self.interval_s = log, interval_s
        self._lock = threading.Lock()
        self._prompt = self._generated = 0
        self._last = None
        self._was_busy = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._recent: collections.deque = collections.deque(maxlen=256)  # for the oversubscription watch
        self.watch: Any = None  # analysis/oversubscription.py's OversubscriptionWatch, set once started

    def attach(self, engine: Any) -> None:
        if self.interval_s <= 0:
            return
        engine.stat_listeners.append(self.on_step)
        self._thread = threading.Thread(target=self._run, name="forwardpass-stats", daemon=True)
        self._thread.start()

    def on_step(self, record: Any) -> None:
        with self._lock:
            self._prompt += record.num_prefill_tokens
            self._generated += record.num_sampled
            self._last = record
            self._recent.append(record)

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            line = self.line(now - t0)
            t0 = now
            if line:
                self.log.info("%s", line)
                if self.watch is not None:  # one warning per process: decode far slower than predicted
                    with self._lock:
                        recent = list(self._recent)
                    self.watch.observe(recent)

    def line(self, elapsed_s: float) -> str | None:
        with self._lock:
            prompt, generated, last = self._prompt, self._generated, self._last
            self._prompt = self._generated = 0
        busy = bool(prompt or generated or (last and (last.num_running or last.num_waiting)))
        if not busy and not self._was_busy:
            return None
        self._was_busy = busy
        running = last.num_running if last else 0
        waiting = last.num_waiting if last else 0
        kv = 100 * last.kv_usage if last else 0.0
        hit = 100 * last.prefix_cache_hit_rate if last else 0.0
        return (f"Avg prompt throughput: {prompt / elapsed_s:.1f} tokens/s, Avg generation throughput: "
                f"{generated / elapsed_s:.1f} tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, "
                f"KV cache usage: {kv:.1f}%, Prefix cache hit rate: {hit:.1f}%")

    def stop(self) -> None:
        self._stop.set()


def serve_logger(level_name: str | None) -> logging.Logger:
    """``forwardpass.serve``: INFO to stderr in uvicorn's format unless ``--log-level`` asks for less."""
    log = logging.getLogger("forwardpass.serve")
    log.propagate = False
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO if level_name is None else level_name.upper())
    return log


class _OneLine(logging.Filter):
    """uvicorn logs a failed start-up (the engine could not load) as a traceback; the command prints the
    error itself in one line, so drop the traceback and uvicorn's "startup failed" line."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if "Traceback (most recent call last)" in msg or msg.startswith("Application startup failed"):
            return False
        return not (record.exc_info and record.levelno >= logging.ERROR and "lifespan" in msg)


@contextlib.contextmanager
def startup_errors_one_line() -> Iterator[None]:
    one_line = _OneLine()
    logger = logging.getLogger("uvicorn.error")
    logger.addFilter(one_line)
    try:
        yield
    finally:
        logger.removeFilter(one_line)
