"""Bad GGUF files, one clear error each and nothing half-made: a truncated file (cut in its tensor data, or in
its header), a tensor whose shape and type disagree with the bytes the file holds for it, an architecture we
do not run. Each is refused from the header by ``LLM(path)`` and by the loader alone, before a model directory
is written (and so before any model is built or kernel compiled)."""

from __future__ import annotations

import os
import shutil

import pytest

pytest.importorskip("gguf")

from forwardpass.assets import default_llm_path  # noqa: E402
from forwardpass.errors import ConfigError  # noqa: E402
from tests.helpers.gguf_files import converter  # noqa: E402


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf") / "embedded-q8_0.gguf"
    converter().convert(default_llm_path(), out, "q8_0")
    return out


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    from torch.utils.cpp_extension import get_default_build_root

    monkeypatch.setenv(
        "TORCH_EXTENSIONS_DIR", os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    )
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _refused(path, match: str, cache) -> None:
    from forwardpass import LLM
    from forwardpass.loader.gguf import gguf_model_dir

    with pytest.raises(ConfigError, match=match):
        gguf_model_dir(path)
    with pytest.raises(ConfigError, match=match):
        LLM(str(path))
    assert not list(cache.glob("forwardpass/gguf/*"))  # no model directory, not even a temporary one


def test_truncated_data(good, tmp_path, cache):
    cut = tmp_path / "cut.gguf"
    data = good.read_bytes()
    cut.write_bytes(data[: len(data) - 4096])
    _refused(cut, r"GGUF file .*cut.gguf cannot be read: it is truncated, damaged or not a GGUF file", cache)


def test_truncated_header(good, tmp_path, cache):
    cut = tmp_path / "header.gguf"
    cut.write_bytes(good.read_bytes()[:300])
    _refused(cut, "cannot be read: it is truncated", cache)


def test_a_tensor_whose_type_disagrees_with_its_bytes(good, tmp_path, cache):
    from gguf import GGMLQuantizationType, GGUFReader

    bad = tmp_path / "retyped.gguf"
    shutil.copy(good, bad)
    reader = GGUFReader(
        str(bad), "r+"
    )  # the header in place: blk.0.ffn_down.weight says Q4_0 over Q8_0 bytes
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    assert t.tensor_type == GGMLQuantizationType.Q8_0
    t.field.parts[4][0] = GGMLQuantizationType.Q4_0
    reader.data.flush()
    del reader
    _refused(bad, r"GGUF tensor blk.0.ffn_down.weight \(Q4_0 \[768x256\]\) is 110592 bytes, "
                  r"but the file holds "
                  r"2088\d\d bytes for it", cache)  # fmt: skip


def test_a_tensor_whose_shape_disagrees_with_its_bytes(good, tmp_path, cache):
    from gguf import GGUFReader

    bad = tmp_path / "reshaped.gguf"
    shutil.copy(good, bad)
    reader = GGUFReader(str(bad), "r+")
    t = next(t for t in reader.tensors if t.name == "blk.1.attn_output.weight")
    t.field.parts[3][1] -= 1  # one row fewer than the file stores
    reader.data.flush()
    del reader
    _refused(
        bad,
        r"GGUF tensor blk.1.attn_output.weight \(Q8_0 \[256x255\]\) is \d+ bytes, but the file holds",
        cache,
    )


def test_an_unknown_architecture(good, tmp_path, cache):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    w.add_block_count(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _refused(tmp_path / "mamba.gguf",
             "GGUF architecture 'mamba' is not supported; supported: llama, qwen2, qwen3",
             cache)  # fmt: skip


@pytest.mark.parametrize(
    "template, limit",
    [
        ("{% for i in range(1000000000) %}x{% endfor %}", "range|limit"),  # a loop that does not end
        ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursion|limit|time"),  # nor does this
    ],
    ids=["loop", "recursion"],
)
def test_a_chat_template_that_does_not_end(template, limit, tmp_path):
    """The file's own chat template is code from the file: one that loops is refused with a clear error when
    the model loads (one bounded test render), not on the first request that renders it."""
    import json

    from forwardpass import LLM
    from forwardpass.errors import ForwardpassError

    model_dir = tmp_path / "model"
    shutil.copytree(default_llm_path(), model_dir)
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    path = tmp_path / "looping.gguf"
    converter().convert(model_dir, path, "q8_0")
    with pytest.raises(ForwardpassError, match=f"(?i)chat template.*is refused.*({limit})"):
        LLM(str(path))
