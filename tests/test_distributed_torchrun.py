"""Multi-node launch: two ``torchrun`` agents on this machine act as two nodes of one rendezvous. The node
that gets rank 0 serves HTTP; the other holds half of the model and computes. (Slow: each node starts
a Python with torch, the rendezvous and the server.)"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest

from forwardpass import LLM, SamplingParams
from tests.helpers.server import REPO, free_port, make_served_model

pytestmark = pytest.mark.slow


def test_two_node_torchrun_serves_a_completion(tmp_path, checkpoint_factory):
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    model = make_served_model(tmp_path / "m", checkpoint_factory("qwen3"))
    rdzv, http = free_port(), free_port()
    cmd = [
        torchrun,
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{rdzv}",
        "--rdzv-id",
        "fp-test",
        "-m",
        "forwardpass",
        "serve",
        "--model",
        str(model),
        "--port",
        str(http),
        "--tensor-parallel-size",
        "2",
        "--num-kv-blocks",
        "64",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "FORWARDPASS_CPU_KERNEL": "0"}
    logs = [open(tmp_path / f"node{i}.log", "wb") for i in range(2)]  # noqa: SIM115 - closed in finally
    nodes = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT) for log in logs]
    try:
        deadline = time.monotonic() + 180
        while True:
            assert all(n.poll() is None for n in nodes), [
                (tmp_path / f"node{i}.log").read_text()[-3000:] for i in range(2)
            ]
            try:
                if httpx.get(f"http://127.0.0.1:{http}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the two-node server did not become healthy"
            time.sleep(0.5)
        body = {"model": "m", "prompt": "hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"http://127.0.0.1:{http}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        one_rank = LLM(str(model), num_kv_blocks=64, cpu_kernels=False).generate(
            "hello", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False
        )
        assert r.json()["choices"][0]["text"] == one_rank[0].outputs[0].text
    finally:
        for n in nodes:
            n.send_signal(signal.SIGTERM)
        for n in nodes:
            try:
                n.wait(30)
            except subprocess.TimeoutExpired:
                n.kill()
        for log in logs:
            log.close()
