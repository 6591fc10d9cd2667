"""Start the real server (``python -m forwardpass.cli serve``) on 127.0.0.1 for tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Self

import httpx

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_served_model(directory: Path, checkpoint: Path) -> Path:
    """A model dir: the tiny random checkpoint (copied: symlinks out of a model dir are refused) plus the
    test tokenizer with its chat template."""
    import shutil

    from tests.helpers.tokenizer_factory import make_test_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    for f in checkpoint.iterdir():
        if not (directory / f.name).exists():
            shutil.copy(f, directory / f.name)
    make_test_tokenizer(directory, "bytelevel", vocab_size=512)
    return directory


MID_STREAM_FAULT_SEED = 424242  # a request with this seed makes a step fail after 2 tokens
FATAL_FAULT_SEED = 131313  # ... makes a step fail and break the KV invariants: the engine dies
SLOW_STEP_SEED = 515151  # ... makes every step it is in take 0.3 s
STUCK_ENGINE_SEED = 616161  # ... makes one step hang for STUCK_S seconds (a stuck engine, then it recovers)
STUCK_S = 7.0


def _fault_engine_class():
    from forwardpass.engine.core import EngineCore

    class FaultInjectingEngine(EngineCore):
        broken = False

        def step(self):
            import time

            seqs = list(self.scheduler.running)
            if any(s.params.seed == STUCK_ENGINE_SEED and len(s.output_token_ids) == 1 for s in seqs):
                time.sleep(STUCK_S)
            if any(s.params.seed == SLOW_STEP_SEED for s in seqs):
                time.sleep(0.3)
            if any(s.params.seed == FATAL_FAULT_SEED for s in seqs):
                self.broken = True
                raise RuntimeError("injected fatal fault")
            if any(s.params.seed == MID_STREAM_FAULT_SEED and len(s.output_token_ids) >= 2 for s in seqs):
                raise RuntimeError("injected step fault")
            return super().step()

        def check_invariants(self):
            if self.broken:
                raise AssertionError("injected broken KV pool")
            super().check_invariants()

    return FaultInjectingEngine


def FaultInjectingEngine(model, config):
    from forwardpass.engine.frontend.launch import build_engine_core

    return build_engine_core(model, config, core_cls=_fault_engine_class())


class ServerProcess:
    """``with ServerProcess(model, *flags) as srv: httpx.get(srv.url + "/health")``."""

    def __init__(self, model: Path, *flags: str, api_key: str | None = None, startup_timeout: float = 120.0,
                 log_path: Path | None = None, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        cmd = [sys.executable, "-m", "forwardpass.cli", "--log-level", "INFO", "serve", "--model", str(model),
               "--port", str(self.port), "--served-model-name", "test-model", "--enable-debug-endpoints",
               *flags]
        if api_key:
            cmd += ["--api-key", api_key]
        self.cmd, self.startup_timeout, self.extra_env = cmd, startup_timeout, env or {}
        self.log_path = log_path or Path(os.environ.get("TMPDIR", "/tmp")) / f"fp-server-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Self:
        # One compute thread: on 2 shared, busy cores, 2 OpenMP threads make a tiny model's step ~15x slower.
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **self.extra_env}
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not become healthy in {self.startup_timeout}s:\n{self.log()}")

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def __exit__(self, *exc) -> None:
        self.stop()
        self._log.close()


def assert_trickled_headers_time_out(url: str, port: int, path: str) -> None:
    """Slowloris: headers trickled in (or never sent) do not hold a connection past the server's
    --read-timeout (2 s in the callers): 408 or a close, and the server still answers afterwards."""
    for opening in (f"POST {path} HTTP/1.1\r\nHost: x\r\n".encode(), b""):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(opening)
            t0 = time.monotonic()
            for _ in range(3):  # a byte now and then does not extend the deadline
                time.sleep(0.5)
                with contextlib.suppress(OSError):
                    s.sendall(b"X")
            reply = s.recv(4096)
            assert reply == b"" or b" 408 " in reply.split(b"\r\n", 1)[0], reply
            assert 1.5 < time.monotonic() - t0 < 8
    assert httpx.get(url + "/health").status_code == 200
