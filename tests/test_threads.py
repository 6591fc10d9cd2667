"""Threads that fit the machine (forwardpass/threads.py): `--threads N` on every command, one default from
the cores this process may use, and one count for torch's pools and the compiled kernels alike."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from forwardpass import threads
from forwardpass.cli import build_parser, main
from forwardpass.errors import ValidationError

REPO = Path(__file__).resolve().parent.parent


def _leaf_commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                out.append(((*prefix, name), child))
                out += _leaf_commands(child, (*prefix, name))
    return out


COMMANDS = _leaf_commands(build_parser())


def test_every_command_is_covered():
    names = {" ".join(path) for path, _ in COMMANDS}
    assert {"generate", "chat", "serve", "explain", "explain-image", "image", "video", "transcribe", "bench",
            "bench serve", "roofline", "models", "warmup"} <= names


@pytest.mark.parametrize("path", [p for p, _ in COMMANDS], ids=[" ".join(p) for p, _ in COMMANDS])
def test_threads_is_accepted_by(path, capsys):
    parser = dict(COMMANDS)[path]
    action = parser._option_string_actions.get("--threads")
    assert action is not None and action.dest == "threads" and action.type is int
    with pytest.raises(SystemExit):  # and shown in its --help
        build_parser().parse_args([*path, "--help"])
    assert "--threads" in capsys.readouterr().out


def test_serve_keeps_num_threads_as_an_alias():
    args = build_parser().parse_args(["serve", "--num-threads", "3"])
    assert args.threads == 3
    assert build_parser().parse_args(["generate", "hi", "--threads", "2"]).threads == 2


def test_a_count_below_one_is_refused_by_name(capsys):
    assert main(["models", "--threads", "0"]) == 1
    assert "--threads must be a positive integer" in capsys.readouterr().err
    with pytest.raises(ValidationError, match="num_threads"):
        threads.check_threads(0, "num_threads")


def test_cgroup_quota_caps_the_affinity_mask(tmp_path, monkeypatch):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert threads.cgroup_quota_cores(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert threads.cgroup_quota_cores(tmp_path) is None
    v1 = tmp_path / "v1"
    v1.mkdir()
    (v1 / "cpu.cfs_quota_us").write_text("100000")
    (v1 / "cpu.cfs_period_us").write_text("100000")
    assert threads.cgroup_quota_cores(v1) == 1.0
    monkeypatch.setattr(threads, "affinity_cores", lambda: 64)
    monkeypatch.setattr(threads, "cgroup_quota_cores", lambda: 1.5)
    assert threads.usable_cores() == 2  # a 1.5-core quota still runs two threads part of the time
    monkeypatch.setattr(threads, "cgroup_quota_cores", lambda: None)
    assert threads.usable_cores() == 64
    monkeypatch.setattr(threads, "affinity_cores", lambda: 3)
    assert threads.default_threads() == 3


# Run in a fresh process: torch's thread count is process-wide. The compiled small-batch matmul runs ~0.5 s
# of work; /proc/self/task/*/stat says which OS threads spent CPU time on it.
_PROBE = r"""
import json, os, sys
from forwardpass import LLM  # first: it sets OMP_WAIT_POLICY before torch loads OpenMP
import torch
from forwardpass.layers.small_matmul import load_small_matmul

n = int(sys.argv[1])
llm = LLM(num_threads=n, num_kv_blocks=16)
matmul = load_small_matmul()

def ticks():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out[tid] = int(fields[11]) + int(fields[12])  # utime + stime
    return out

x, w = torch.randn(4, 2048), torch.randn(8192, 2048)
matmul(x, w)
before = ticks()
for _ in range(60):
    matmul(x, w)
after = ticks()
busy = sorted(after[t] - before.get(t, 0) for t in after)
print(json.dumps({"torch": torch.get_num_threads(), "llm": llm.num_threads, "kernel": matmul is not None,
                  "busy_threads": sum(1 for b in busy if b >= 3), "ticks": busy[-4:],
                  "policy": os.environ.get("OMP_WAIT_POLICY")}))
"""


def _probe(n: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("OMP_NUM_THREADS", None)
    out = subprocess.run([sys.executable, "-c", _PROBE, str(n)], env=env, capture_output=True, text=True,
                         timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_llm_num_threads_sets_torch_and_the_kernels():
    one = _probe(1)
    assert one["torch"] == 1 and one["llm"] == 1 and one["kernel"]
    assert one["busy_threads"] == 1, one  # the kernel's parallel_for ran on this thread alone
    assert one["policy"] == "passive"  # set by `import forwardpass`, before torch loaded
    if threads.usable_cores() < 2:
        pytest.skip("one usable core: no second thread to see")
    two = _probe(2)
    assert two["torch"] == 2 and two["busy_threads"] >= 2, two  # the control: the probe sees a second thread


def test_image_and_video_pipelines_take_num_threads(monkeypatch):
    """Each call computes with the pipeline's count and gives the caller's back afterwards."""
    import torch

    from forwardpass.diffusion import DEFAULT_MODEL_DIR
    from forwardpass.diffusion.pipeline import ImagePipeline
    from forwardpass.diffusion.video import DEFAULT_VIDEO_MODEL_DIR
    from forwardpass.diffusion.video.pipeline import VideoPipeline

    seen = []
    record = lambda *args: seen.append(torch.get_num_threads()) or {}  # noqa: E731 - the step callback
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "_explicit", [])  # as in a fresh process: no --threads given
    try:
        torch.set_num_threads(2)
        pipe = ImagePipeline.from_pretrained(DEFAULT_MODEL_DIR)
        pipe("a handwritten 7", num_inference_steps=2, show_progress=False, callback_on_step_end=record)
        assert pipe.num_threads is None and seen == [1, 1]  # the CLI's default for a tiny model
        assert torch.get_num_threads() == 2  # the caller's count, back
        pipe = ImagePipeline.from_pretrained(DEFAULT_MODEL_DIR, num_threads=3)
        pipe("a handwritten 7", num_inference_steps=1, show_progress=False, callback_on_step_end=record)
        assert seen[-1] == 3
        video = VideoPipeline.from_pretrained(DEFAULT_VIDEO_MODEL_DIR, num_threads=1)
        video("a handwritten 3 moving left", num_inference_steps=1, show_progress=False,
              callback_on_step_end=record)
        assert video.num_threads == 1 and seen[-1] == 1 and torch.get_num_threads() == 2
        with pytest.raises(ValidationError, match="num_threads"):
            ImagePipeline.from_pretrained(DEFAULT_MODEL_DIR, num_threads=0)
    finally:
        torch.set_num_threads(before)
