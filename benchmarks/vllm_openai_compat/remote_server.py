"""Stands in for vLLM's ``tests/utils.py`` in the harness's work tree: ``RemoteOpenAIServer`` launches
``forwardpass serve`` instead of ``vllm serve``.

vLLM's tests name Hugging Face models (``facebook/opt-125m``, ``Qwen/Qwen3-0.6B``, ...) that this machine
cannot download; the server runs the model ``plan.model_for`` picks (the embedded model, or SmolLM2 for the
tests written for it) under the name the test sends, so every ``model=MODEL_NAME`` request reaches it.
vLLM's command-line flags are translated (``plan.translate_args``): ours where we have them, dropped where
they only tune vLLM (``--enforce-eager``, ``--gpu-memory-utilization``); each dropped flag that changes what
the server answers is printed, so a test that fails for it can be traced to it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
import requests

from benchmarks.vllm_openai_compat import plan

VLLM_PATH = Path(os.environ.get("FORWARDPASS_VLLM_SRC", "."))
ROCM_EXTRA_ARGS: list[str] = []
_STARTUP_S = 300.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteOpenAIServer:
    """``forwardpass serve`` in a child process for the lifetime of a ``with`` block (vLLM's interface)."""

    DUMMY_API_KEY = "token-abc123"  # vLLM's servers accept any key unless --api-key is given

    def __init__(self, model: str, vllm_serve_args: list[str], *, env_dict: dict[str, str] | None = None,
                 seed: int | None = 0, auto_port: bool = True, max_wait_seconds: float | None = None,
                 override_hf_configs: dict[str, Any] | None = None) -> None:
        args, dropped = plan.translate_args(list(vllm_serve_args))
        # vLLM reads its key from VLLM_API_KEY too
        if "api-key" not in args and (env_dict or {}).get("VLLM_API_KEY"):
            args["api-key"] = (env_dict or {})["VLLM_API_KEY"]
        self.port = args.pop("port", None) or _free_port()
        self.host = "127.0.0.1"
        self.api_key = args.get("api-key")
        if seed is not None and "seed" not in args:
            args["seed"] = str(seed)
        ours = plan.model_for(model, os.environ.get("PYTEST_CURRENT_TEST", ""))
        dropped += plan.fit_context(args, ours)
        cmd = [sys.executable, "-m", "forwardpass", "serve", "--model", ours,
               "--served-model-name", args.pop("served-model-name", model), "--port", str(self.port),
               "--threads", "1", "--no-access-log", "--log-stats-interval", "0"]
        for flag, value in args.items():
            cmd += [f"--{flag}"] if value is None else [f"--{flag}", value]
        if dropped:
            print(f"[compat] vLLM flags without an equivalent here, dropped: {' '.join(dropped)}")
        print(f"[compat] launching: {' '.join(cmd)}")
        env = {**os.environ, **(env_dict or {})}
        self.proc = subprocess.Popen(cmd, env=env, stdout=sys.stdout, stderr=sys.stderr,
                                     start_new_session=True)
        try:
            self._wait_for_server(max_wait_seconds or _STARTUP_S)
        except BaseException:
            self._shutdown()
            raise

    def _wait_for_server(self, timeout: float) -> None:
        start = time.monotonic()
        while True:
            try:
                if requests.get(self.url_for("health"), timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"forwardpass serve exited with {self.proc.returncode} before it was up")
            if time.monotonic() - start > timeout:
                raise RuntimeError("forwardpass serve did not come up in time")
            time.sleep(0.5)

    def __enter__(self) -> RemoteOpenAIServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._shutdown()

    def _shutdown(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    @property
    def url_root(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        return f"{self.url_root}/" + "/".join(p.strip("/") for p in parts if p)

    def _key(self) -> str:
        return self.api_key or self.DUMMY_API_KEY

    def get_client(self, **kwargs: Any) -> openai.OpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self._key(), max_retries=0, **kwargs)

    def get_async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self._key(), max_retries=0, **kwargs)


def _skip_decorator(reason: str) -> Callable[..., Any]:
    def make(*_args: Any, **_kwargs: Any) -> Any:
        return pytest.mark.skip(reason=reason)
    return make


multi_gpu_only = _skip_decorator("needs several GPUs")
multi_gpu_test = _skip_decorator("needs several GPUs")
large_gpu_test = _skip_decorator("needs a large GPU")
requires_fp8 = pytest.mark.skip(reason="needs FP8 hardware")
