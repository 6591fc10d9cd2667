"""Every GGUF weight type in a model: the embedded model written as F32 by our converter, then requantized by
llama.cpp itself to its presets (Q4_1, Q5_0, Q5_1, Q2_K, Q3_K_M, Q4_K_M, Q5_K_M, Q6_K, BF16: files that mix
types per tensor, as real ones do). Each loads with the weight kind its types call for, and against
transformers' GGUF reader (the same file dequantized to fp32): equal logits to 1e-4 on the
dequantize-then-fp32 path, and within the int8 activations' rounding on the K-block kernel path, which the
kernel's call counter shows ran."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("llama_cpp")

from forwardpass.assets import default_llm_path  # noqa: E402
from forwardpass.quant.kblock_weight import GEMM_ROWS, KBlockStack, KBlockWeight, RowStack  # noqa: E402
from forwardpass.quant.weight import QuantizedWeight  # noqa: E402
from tests.helpers.gguf_files import converter  # noqa: E402
from tests.helpers.requantize import requantize  # noqa: E402

PRESETS = ["Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "BF16"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf-types")
    converter().convert(default_llm_path(), out / "embedded-f32.gguf", "f32")
    for preset in PRESETS:
        requantize(out / "embedded-f32.gguf", out / f"embedded-{preset}.gguf", preset)
    return out


@pytest.fixture(autouse=True)
def one_thread(tmp_path, monkeypatch):
    from torch.utils.cpp_extension import get_default_build_root

    # model directories in a fresh cache, compiled kernels where they already are (not rebuilt for each test)
    monkeypatch.setenv(
        "TORCH_EXTENSIONS_DIR", os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    )
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _weights(model) -> Counter:
    kinds: Counter = Counter()
    for m in model.modules():
        w = getattr(m, "weight", None)
        parts = list(w.parts) if isinstance(w, RowStack) else [w]
        for p in parts:
            if isinstance(p, KBlockStack):  # parts of different types in one K-block weight
                kinds.update(p.kinds)
            elif isinstance(p, (KBlockWeight, QuantizedWeight)):
                kinds[p.fmt] += 1
    return kinds


def _file_types(path) -> set[str]:
    from gguf import GGUFReader

    return {t.tensor_type.name.lower() for t in GGUFReader(str(path)).tensors} - {"f32", "f16", "bf16"}


def _logits(model, ids):
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids))))


@pytest.mark.parametrize("preset", PRESETS)
def test_every_type_computes_transformers_logits(files, preset, monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM

    from forwardpass.loader.gguf import gguf_model_dir
    from forwardpass.models.gguf_weights import load_gguf_model
    from forwardpass.quant.kernel import load_kblock_kernel

    name = f"embedded-{preset}.gguf"
    cfg = AutoConfig.from_pretrained(files, gguf_file=name)
    cfg.head_dim = (
        64  # transformers' GGUF config mapping drops qwen3's attention.key_length (see test_gguf.py)
    )
    hf = AutoModelForCausalLM.from_pretrained(files, gguf_file=name, config=cfg, dtype=torch.float32).eval()
    ids = torch.arange(3, 3 + GEMM_ROWS + 8)
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    # the dequantize-then-fp32-GEMM path (prompts of >= GEMM_ROWS rows): transformers' math on the same values
    monkeypatch.setenv("FORWARDPASS_QUANT_GEMM", "fp32")
    ours = load_gguf_model(gguf_model_dir(files / name))[0]
    assert set(_weights(ours)) == _file_types(files / name)  # each quantized type in the weight built for it
    torch.testing.assert_close(_logits(ours, ids), want, rtol=1e-4, atol=1e-4)
    # a batch of 8 rows: every matmul on the kernels (int8 activations)
    kernel = load_kblock_kernel()
    before = kernel.calls() if kernel is not None else 0
    got = _logits(ours, ids[:8])
    assert (got - want[:8]).norm() < 0.03 * want[:8].norm()
    assert (got.argmax(-1) == want[:8].argmax(-1)).float().mean() >= 0.75
    if set(_weights(ours)) - {"q8_0", "q4_0"}:
        assert kernel is not None and kernel.calls() > before  # the K-block kernel computed those rows
