"""``KernelLoader`` (forwardpass/kernel_build.py), what every ``load_*_kernel`` is: built once and kept, a
failure remembered and said once, an environment switch read at each call, a check on the loaded module."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from forwardpass.kernel_build import KernelLoader

logger = logging.getLogger(__name__)


class FakeKernel:
    """A ``CppKernel`` stand-in: counts its builds; ``error`` makes them fail."""

    what = "the fake kernel"

    def __init__(self, error: Exception | None = None):
        self.error, self.loads = error, 0

    def load(self, log):
        self.loads += 1
        if self.error is not None:
            raise self.error
        return SimpleNamespace(available=lambda: True, paged_decode=lambda *args: None)


def _loader(kernel, **kwargs):
    return KernelLoader(kernel, "using the slow path", logger, **kwargs)  # type: ignore[arg-type]


def test_loaded_once_and_kept():
    kernel = FakeKernel()
    loader = _loader(kernel)
    module = loader.load()
    assert module is not None and loader.load() is module and kernel.loads == 1 and not loader.pending


def test_a_failure_is_remembered_and_said_once(caplog):
    kernel = FakeKernel(OSError("no compiler"))
    loader = _loader(kernel)
    with caplog.at_level(logging.WARNING, logger=__name__):
        assert loader.load() is None and loader.load() is None
    assert kernel.loads == 1 and loader.failed
    assert [r.getMessage() for r in caplog.records] == [
        "the fake kernel unavailable (no compiler); using the slow path"
    ]


def test_the_switch_is_read_at_each_call(monkeypatch):
    kernel = FakeKernel()
    loader = _loader(kernel, switch="FORWARDPASS_QUANT_KERNEL")
    monkeypatch.setenv("FORWARDPASS_QUANT_KERNEL", "0")
    assert loader.load() is None and kernel.loads == 0 and not loader.failed  # off is not a failure
    monkeypatch.setenv("FORWARDPASS_QUANT_KERNEL", "1")
    assert loader.load() is not None and kernel.loads == 1
    monkeypatch.setenv("FORWARDPASS_QUANT_KERNEL", "0")
    assert loader.load() is not None  # loaded is loaded: an engine never swaps its kernels mid-run


def test_a_check_that_raises_is_a_failure(caplog):
    def refuse(module):
        raise RuntimeError("no AMX tile state")

    loader = _loader(FakeKernel(), check=refuse)
    with caplog.at_level(logging.WARNING, logger=__name__):
        assert loader.load() is None
    assert loader.failed and "no AMX tile state" in caplog.text


def test_not_ready_waits_without_loading():
    """``ready`` (load_paged_decode(wait=False): the kernels not built yet) answers None for now."""
    kernel = FakeKernel()
    loader = _loader(kernel)
    assert loader.load(ready=lambda: False) is None and kernel.loads == 0 and loader.pending
    assert loader.load(ready=lambda: True) is not None and kernel.loads == 1


def test_paged_decode_never_builds_in_the_background(monkeypatch):
    """``load_paged_decode(wait=False)``: None while the kernels are not built, and nothing started (no
    detached build that outlives the command); ``"auto"`` builds in this process, then uses the kernel."""
    from forwardpass.attention import cpu_kernel

    assert not hasattr(cpu_kernel, "subprocess")  # no process is ever started to build it
    built = SimpleNamespace(now=False)
    monkeypatch.setattr(cpu_kernel, "is_built", lambda: built.now)
    kernel = FakeKernel()
    monkeypatch.setattr(cpu_kernel, "LOADER", _loader(kernel, switch="FORWARDPASS_CPU_KERNEL"))
    monkeypatch.delenv("FORWARDPASS_CPU_KERNEL", raising=False)
    assert cpu_kernel.load_paged_decode(wait=False) is None and kernel.loads == 0
    monkeypatch.setattr(cpu_kernel, "_auto_decision", [])
    import torch

    decode = cpu_kernel.resolve_decode_kernel("auto", "cpu", torch.float32, "sdpa")
    assert decode is cpu_kernel.LOADER.module.paged_decode and kernel.loads == 1  # built in the foreground
    assert cpu_kernel.fused_ops_for(decode) is cpu_kernel.LOADER.module
    assert cpu_kernel.fused_ops_for(len) is None  # not the kernel this process loaded


def test_the_package_loaders_keep_their_names():
    from forwardpass.attention import cpu_kernel
    from forwardpass.layers import small_matmul
    from forwardpass.quant import kernel

    switches = {cpu_kernel.LOADER: "FORWARDPASS_CPU_KERNEL", small_matmul.LOADER: "FORWARDPASS_CPU_KERNEL",
                kernel.LOADER: "FORWARDPASS_QUANT_KERNEL", kernel.AMX_LOADER: None}  # fmt: skip
    assert all(loader.switch == switch for loader, switch in switches.items())
    assert kernel.AMX_LOADER.check is not None
    with pytest.raises(RuntimeError, match="AMX tile state"):
        kernel.AMX_LOADER.check(SimpleNamespace(available=lambda: False))


def test_shared_headers_are_named_and_searched(tmp_path):
    """A header kernels of two folders include lives in ``forwardpass/csrc/`` (``SHARED_CSRC``): each kernel
    that includes it names it in ``headers=`` (so a change to it rebuilds the kernel) and gets its folder as
    an include path; no source reaches into another kernel's folder."""
    from forwardpass.kernel_build import SHARED_CSRC, CppKernel
    from forwardpass.layers import small_matmul
    from forwardpass.quant import kernel

    for k in (small_matmul.KERNEL, kernel.AMX_KERNEL):
        assert SHARED_CSRC / "transpose16.h" in k.headers and str(SHARED_CSRC.resolve()) in k.include_paths
        assert "../" not in k.source.read_text()
    own, shared = tmp_path / "own", tmp_path / "shared"
    own.mkdir(), shared.mkdir()
    (own / "k.cpp").write_text('#include "h.h"\n')
    (shared / "h.h").write_text("// one\n")
    k = CppKernel("k", own / "k.cpp", cflags=(), headers=(shared / "h.h",))
    before = k.build_name
    (shared / "h.h").write_text("// two\n")
    assert k.build_name != before and k.include_paths == [str(shared.resolve())]
