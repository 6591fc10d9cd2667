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
    assert {b.group for b in planned_builds(["quant", "kblock"])} == {"quant", "kblock"}


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
