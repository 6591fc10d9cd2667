"""Checks before work: a GGUF file with a tensor type we cannot read (here TQ1_0, a ternary type) is refused
from its header (the tensor infos, no data read) before a model is built or any kernel compiled for it, not
when loading reaches that tensor; whether the engine starts from the file or from a model directory made of it
before the check existed. The message names the tensor, its type and every supported type."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("gguf")

from forwardpass.assets import default_llm_path
from forwardpass.errors import ConfigError
from forwardpass.kernel_build import CppKernel, KernelLoader
from forwardpass.loader import gguf_checks
from tests.helpers.gguf_files import converter

#: the last tensor loading reaches (the last layer's down projection): every kernel would be built by then
LAYERS = json.loads((default_llm_path() / "config.json").read_text())["num_hidden_layers"]
LAST = f"blk.{LAYERS - 1}.ffn_down.weight"


@pytest.fixture(scope="module")
def tq_file(tmp_path_factory):
    """The embedded model as a Q8_0 file (the kernels' format) whose LAST tensor is TQ1_0 (which we do not
    read)."""
    from gguf import GGMLQuantizationType

    conv = converter()
    q8_0 = conv.tensor_type
    conv.tensor_type = lambda name, *args: GGMLQuantizationType.TQ1_0 if name == LAST else q8_0(name, *args)
    out = tmp_path_factory.mktemp("gguf") / "tq1-down.gguf"
    conv.convert(default_llm_path(), out, "q8_0")
    return out


@pytest.fixture(autouse=True)
def gguf_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture
def kernel_loads(monkeypatch):
    """Every kernel load or build of the process, recorded (and refused: none may happen here)."""
    asked = []

    def loader_load(self, ready=None):
        asked.append(self.kernel.what)
        raise AssertionError(f"{self.kernel.what} loaded before the file was checked")

    def build(self, logger):
        asked.append(self.what)
        raise AssertionError(f"{self.what} built before the file was checked")

    monkeypatch.setattr(KernelLoader, "load", loader_load)
    monkeypatch.setattr(CppKernel, "load", build)
    return asked


def _refused(fn):
    supported = "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K"
    with pytest.raises(ConfigError, match=f"GGUF tensor {LAST} has type TQ1_0; supported: {supported}"):
        fn()


def test_an_engine_refuses_the_file_before_any_kernel(tq_file, kernel_loads, tmp_path):
    from forwardpass import LLM

    _refused(lambda: LLM(str(tq_file), cpu_kernels=True))  # True: the decode kernel is built and waited on
    assert kernel_loads == []
    assert not list((tmp_path / "cache").glob("forwardpass/gguf/*"))  # no model directory for it either


def test_a_directory_made_before_the_check_is_refused_too(tq_file, kernel_loads, monkeypatch):
    from forwardpass import LLM
    from forwardpass.loader.gguf import gguf_model_dir
    from forwardpass.models.gguf_weights import load_gguf_model

    # a directory from a release without the check (or the file replaced since)
    with monkeypatch.context() as m:
        m.setattr(gguf_checks, "check_tensor_types", lambda reader: None)
        model_dir = gguf_model_dir(tq_file)
    _refused(lambda: LLM(str(model_dir), cpu_kernels=True))
    _refused(lambda: load_gguf_model(model_dir))  # called on its own too
    assert kernel_loads == []


def test_the_message_counts_what_the_file_lacks(tq_file):
    from gguf import GGUFReader

    reader = GGUFReader(str(tq_file))
    with pytest.raises(ConfigError, match=rf"\(1 of the file's {len(reader.tensors)} tensors are TQ1_0\)"):
        gguf_checks.check_tensor_types(reader)
