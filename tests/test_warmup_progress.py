"""Compiles that say what they do: `forwardpass warmup` builds the kernels this machine's plans load, one
line each; a compile inside the command's spinner names itself on that same line (forwardpass/progress.py)
instead of drawing a second display over it."""

from __future__ import annotations

import json
import sys

import pytest

from forwardpass.cli import main


def test_warmup_builds_what_the_engine_loads(capsys):
    from forwardpass.attention import cpu_kernel
    from forwardpass.commands.warmup import planned_builds
    from forwardpass.layers import small_matmul

    assert main(["warmup", "--kernels", "decode", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    builds = [cpu_kernel.KERNEL.build_name, small_matmul.KERNEL.build_name]
    assert [k["build"] for k in doc["kernels"]] == builds
    assert all(k["outcome"] in ("built", "already built") for k in doc["kernels"]) and doc["failed"] == 0
    assert cpu_kernel.is_built()  # what an engine's "auto" decision now finds, without building
    assert main(["warmup", "--kernels", "decode"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"[1/2] {cpu_kernel.KERNEL.what}: already built",
                     f"[2/2] {small_matmul.KERNEL.what}: already built"]
    assert [b.group for b in planned_builds(["kblock", "quant"])] == ["kblock", "quant"]  # the order asked


def test_warmup_says_when_a_kernel_is_switched_off(capsys, monkeypatch):
    from forwardpass.commands.warmup import planned_builds

    monkeypatch.setenv("FORWARDPASS_QUANT_KERNEL", "0")
    [build] = planned_builds(["quant"])
    if build.loader.module is not None:
        pytest.skip("this process loaded the quantized kernel already")
    assert main(["warmup", "--kernels", "quant", "--json"]) == 0
    [k] = json.loads(capsys.readouterr().out)["kernels"]
    assert k["outcome"] == "switched off (FORWARDPASS_QUANT_KERNEL=0)"
    assert main(["warmup", "--kernels", "nope"]) == 1
    assert "choose from decode, quant, kblock, amx" in capsys.readouterr().err


def test_a_compile_inside_the_loading_spinner_names_itself_on_the_same_line():
    pexpect = pytest.importorskip("pexpect")
    code = ("import logging, time\n"
            "from forwardpass.commands._common import progress\n"
            "from forwardpass.kernel_build import compile_progress\n"
            "with progress('loading the test model'):\n"
            "    time.sleep(1.2)\n"
            "    with compile_progress('the test kernel', 30, logging.getLogger('t')):\n"
            "        time.sleep(1.5)\n"
            "    time.sleep(1.2)\n"
            "print('loaded')\n")
    child = pexpect.spawn(sys.executable, ["-c", code], encoding="utf-8", timeout=60, dimensions=(24, 120))
    child.expect(pexpect.EOF)
    screen = child.before
    child.close()
    # one status line redrawn in place (carriage returns): loading, then the compile, then loading again
    first = screen.index("loading the test model...")
    compiling = screen.index("compiling the test kernel (once, ~30 s; cached afterwards)...")
    back = screen.index("loading the test model...", compiling)
    assert first < compiling < back
    assert "\n" not in screen[first:back]  # never a second display: no line was added meanwhile
    assert "loading the test model: done in" in screen and screen.rstrip().endswith("loaded")


class SleepyKernel:
    """Stands for a CppKernel in the parallel build: its ``load`` notes when and where it ran."""

    def __init__(self, name: str, log_dir: str, expected_s: int = 30) -> None:
        self.build_name, self.what, self.log_dir, self.expected_s = name, name, log_dir, expected_s

    def load(self, logger) -> None:
        import os
        import time
        from pathlib import Path

        start = time.time()
        time.sleep(3)
        Path(self.log_dir, self.build_name).write_text(f"{os.getpid()} {start} {time.time()}")


def test_kernels_compile_side_by_side_in_processes_of_their_own(tmp_path):
    from forwardpass.commands.warmup import compile_side_by_side

    kernels = [SleepyKernel(f"k{i}", str(tmp_path)) for i in range(2)]
    done = []
    compile_side_by_side(kernels, 2, lambda k, s: done.append((k.build_name, s)))
    assert sorted(name for name, _ in done) == ["k0", "k1"] and all(s >= 3 for _, s in done)
    (pid0, start0, end0), (pid1, start1, end1) = (
        [float(x) for x in (tmp_path / f"k{i}").read_text().split()] for i in range(2))
    assert len({pid0, pid1, __import__("os").getpid()}) == 3  # each in its own process, not this one
    assert start1 < end0 and start0 < end1  # at the same time, not one after the other


def test_the_estimate_packs_the_longest_builds_first_and_a_gguf_model_asks_for_its_kernel_first(tmp_path):
    from forwardpass.commands.warmup import estimate_s, groups_first, ordered
    from forwardpass.loader.gguf import MARKER

    kernels = [SleepyKernel(n, "", s) for n, s in (("a", 45), ("b", 25), ("c", 25), ("d", 20))]
    assert estimate_s(kernels, 1) == 115 and estimate_s(kernels, 2) == 65 and estimate_s(kernels, 8) == 45
    (tmp_path / MARKER).write_text("{}")
    assert groups_first(tmp_path) == ["kblock", "decode"]
    assert groups_first(tmp_path.parent) == ["decode"]
    assert ordered(["decode", "quant", "kblock"], []) == ["decode", "quant", "kblock"]


def test_every_kernel_includes_the_light_torch_header():
    """torch/extension.h parses torch's whole C++ frontend (two thirds of a kernel's compile); the kernels
    include forwardpass/csrc/torch_ext.h instead, and name it, so a change to it rebuilds them."""
    from forwardpass.commands.warmup import GROUPS, planned_builds
    from forwardpass.kernel_build import TORCH_EXT
    from forwardpass.quant import kernel

    for k in [b.kernel for b in planned_builds(list(GROUPS))] + [kernel.AMX_KERNEL]:
        text = "".join(p.read_text() for p in (k.source, *k.headers))
        assert "#include <torch/extension.h>" not in text, k.name
        assert '#include "torch_ext.h"' in k.source.read_text() and TORCH_EXT in k.headers, k.name
