"""A model too big for the memory given is refused at start-up, before its weights are read, with the numbers
(needed, available, which limit) and the flags that lower the need: under ``--max-memory`` and under an
address-space limit (``ulimit -v``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from forwardpass.assets import default_llm_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}

pytestmark = pytest.mark.timeout(120)


def test_serve_refuses_a_model_over_max_memory_before_loading():
    cmd = [sys.executable, "-m", "forwardpass", "serve", str(default_llm_path()), "--port", "0",
           "--max-memory", "0.5"]
    out = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=100)
    assert out.returncode == 1, out.stderr
    error = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "Traceback" not in out.stderr, out.stderr
    # the numbers: the default 1 GiB KV pool + the weights, against the knob
    assert "the model needs at least 1.02 GiB" in error[0] and "KV cache 1.00 GiB" in error[0]
    assert "but 0.50 GiB is available (--max-memory)" in error[0]
    assert "--kv-cache-memory" in error[0] and "--quantization int8 or int4" in error[0]
    assert "loading" not in out.stderr  # refused before the engine started loading


def test_a_smaller_kv_cache_fits_the_same_limit(tmp_path):
    from forwardpass.config import EngineConfig
    from forwardpass.memory_need import check_memory

    need = check_memory(default_llm_path(), EngineConfig(kv_cache_memory=64 << 20), max_memory=512 << 20)
    assert need.kv_cache_bytes == 64 << 20 and 0 < need.weights_bytes < 64 << 20


def test_the_address_space_limit_counts():
    """Under ``ulimit -v`` (RLIMIT_AS) the limit less what the process has mapped is what is available."""
    script = textwrap.dedent(f"""
        import resource
        from pathlib import Path
        from forwardpass.config import EngineConfig
        from forwardpass.errors import ForwardpassError
        from forwardpass.memory_need import available_memory, check_memory
        vm = next(int(l.split()[1]) * 1024 for l in Path("/proc/self/status").read_text().splitlines()
                  if l.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (768 << 20), resource.RLIM_INFINITY))
        avail = available_memory()
        assert avail.source.startswith("the address-space limit"), avail
        assert (700 << 20) < avail.bytes <= (768 << 20), avail
        try:
            check_memory({str(default_llm_path())!r}, EngineConfig())
        except ForwardpassError as exc:
            print(exc)
        else:
            raise SystemExit("not refused")
        check_memory({str(default_llm_path())!r}, EngineConfig(kv_cache_memory=256 << 20))
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=ENV, capture_output=True, text=True,
                         timeout=100)
    assert out.returncode == 0, out.stderr
    assert "is available (the address-space limit (ulimit -v))" in out.stdout


def test_llm_refuses_a_kv_cache_larger_than_the_machine_before_loading(monkeypatch):
    """``LLM()`` (and so ``generate`` and ``chat``) checks before it loads: a 1 PiB KV cache is refused with
    the numbers, and no weight is read."""
    from forwardpass import LLM
    from forwardpass.memory_need import InsufficientMemoryError
    from forwardpass.models import loading

    def no_load(*args, **kwargs):
        raise AssertionError("weights were loaded before the memory check")

    monkeypatch.setattr(loading, "load_weights", no_load)
    refused = r"KV cache 1048576\.00 GiB\) but [\d.]+ GiB is available"
    with pytest.raises(InsufficientMemoryError, match=refused):
        LLM(default_llm_path(), kv_cache_memory=1 << 50)
