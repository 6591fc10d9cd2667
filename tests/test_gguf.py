"""GGUF: our converter (scripts/to_gguf.py) and loader (forwardpass/loader/gguf.py), with transformers' own
GGUF reader as the oracle: greedy tokens equal for F32/F16 files; Q8_0/Q4_0 files give transformers' logits
on the same dequantized weights, and their blocks reach our kernels byte for byte."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")

from forwardpass.assets import default_llm_path
from forwardpass.quant import formats
from forwardpass.quant.weight import GEMM_ROWS, QuantizedWeight
from tests.helpers.gguf_files import converter

PROMPT = "It is a truth universally acknowledged, that a single man in possession of a good fortune"


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """The embedded model as GGUF files of each type (in one directory, as transformers expects)."""
    out = tmp_path_factory.mktemp("gguf")
    conv = converter()
    for t in ("f32", "f16", "q8_0", "q4_0"):
        conv.convert(default_llm_path(), out / f"embedded-{t}.gguf", t)
    return out


@pytest.fixture(autouse=True)
def gguf_cache(tmp_path, monkeypatch):
    import os

    from torch.utils.cpp_extension import get_default_build_root

    # model directories in a fresh cache, compiled kernels where they already are (not rebuilt there)
    build_root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", build_root)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    # numbers, not speed: one thread (two OpenMP threads on a loaded 2-core machine wait on each other)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _transformers(directory: Path, name: str):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cfg = AutoConfig.from_pretrained(directory, gguf_file=name)
    # transformers' GGUF config mapping drops qwen3's head_dim (attention.key_length) and falls back to
    # Qwen3Config's default of 128: give it the file's value
    cfg.head_dim = 64
    model = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, config=cfg, dtype=torch.float32
    ).eval()
    return model, AutoTokenizer.from_pretrained(directory, gguf_file=name)


def _our_model(path: Path):
    from forwardpass.loader.gguf import gguf_model_dir
    from forwardpass.models.gguf_weights import load_gguf_model

    return load_gguf_model(gguf_model_dir(path))[0]


@pytest.mark.parametrize("kind", ["f32", "f16"])
def test_float_files_generate_what_transformers_generates(gguf_files, kind):
    from forwardpass import LLM
    from forwardpass.sampling.params import SamplingParams

    name = f"embedded-{kind}.gguf"
    hf, hf_tok = _transformers(gguf_files, name)
    llm = LLM(str(gguf_files / name), cpu_kernels=False)  # not waiting on the attention kernel's build
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[
        0
    ]
    ids = hf_tok(PROMPT)["input_ids"]
    assert out.prompt_token_ids == ids
    want = hf.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False)[
        0, len(ids) :
    ]
    assert out.outputs[0].token_ids == want.tolist()


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_quantized_files_match_transformers_on_the_same_weights(gguf_files, kind, monkeypatch):
    """Asked for the dequantize-then-fp32 GEMM (``FORWARDPASS_QUANT_GEMM=fp32``, on every CPU), a prompt gives
    transformers' logits on the same dequantized weights to 1e-4; with this CPU's own large-batch path (int8
    activations on AVX2 or VNNI, bf16 on AMX) within the rounding of its operands: measured 0.18% (AMX) and
    0.5% (AVX2) relative error, 96-100% top-1 agreement over 56 positions."""
    name = f"embedded-{kind}.gguf"
    # not bf16 or int8 activations: transformers' fp32 math
    monkeypatch.setenv("FORWARDPASS_QUANT_GEMM", "fp32")
    ours = _our_model(gguf_files / name)
    down = ours.model.layers[0].mlp.down_proj.weight
    assert isinstance(down, QuantizedWeight) and down.fmt == kind
    # the file's blocks reach the kernel unchanged: they are our quantizer's bytes of the original weights
    from forwardpass.models.loading import load_model

    original = load_model(default_llm_path())[0].model.layers[0].mlp.down_proj.weight
    qs, d = formats.quantize(original, kind)
    assert all(map(torch.equal, down.gguf_layout(), (qs, d)))  # the file's bytes (in whichever layout)
    # prompts of >= GEMM_ROWS rows compute with the dequantized weights in fp32: transformers' math
    hf, _ = _transformers(gguf_files, name)
    ids = torch.arange(3, 3 + GEMM_ROWS + 8)
    with torch.no_grad():
        got = ours.compute_logits(ours(ids, torch.arange(len(ids))))
        want = hf(ids[None]).logits[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    monkeypatch.delenv("FORWARDPASS_QUANT_GEMM")  # this CPU's own path for many rows
    ours = _our_model(gguf_files / name)
    with torch.no_grad():
        got = ours.compute_logits(ours(ids, torch.arange(len(ids))))
    assert (got - want).norm() < 0.01 * want.norm()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_tokenizer_and_chat_template_come_from_the_file(gguf_files):
    from forwardpass.loader.gguf import gguf_model_dir
    from forwardpass.loader.tokenizer import Tokenizer

    ours = Tokenizer.from_dir(gguf_model_dir(gguf_files / "embedded-q8_0.gguf"))
    original = Tokenizer.from_dir(default_llm_path())
    text = (default_llm_path().parent / "data" / "austen_heldout.txt").read_text()[:20000]
    assert ours.encode(text) == original.encode(text)
    chat = [{"role": "user", "content": "Who is Mr. Darcy?"}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True) == original.apply_chat_template(
        chat, add_generation_prompt=True
    )
    assert ours.eos_token_id == original.eos_token_id


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_llama_and_qwen2_files_equal_their_checkpoints(tmp_path, variant):
    """Llama's permuted q/k rows and Qwen2's biases: the GGUF model equals the safetensors model."""
    from forwardpass.models.loading import load_model
    from tests.helpers.checkpoints import make_checkpoint
    from tests.helpers.moe_checkpoints import copy_with_tokenizer

    overrides = {"rope_scaling": None} if variant == "llama" else {}
    ckpt = copy_with_tokenizer(make_checkpoint(tmp_path / "ckpt", variant, **overrides), tmp_path / "model")
    converter().convert(ckpt, tmp_path / "m.gguf", "f32")
    ids = torch.arange(3, 40)
    with torch.no_grad():
        ref = load_model(ckpt)[0]
        gg = _our_model(tmp_path / "m.gguf")
        torch.testing.assert_close(
            gg.compute_logits(gg(ids, torch.arange(len(ids)))),
            ref.compute_logits(ref(ids, torch.arange(len(ids)))),
            rtol=1e-5,
            atol=1e-5,
        )


def test_unsupported_files_are_clear_errors(tmp_path):
    import gguf

    from forwardpass.errors import ConfigError
    from forwardpass.loader.gguf import gguf_model_dir

    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "falcon")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match="GGUF architecture 'falcon' is not supported"):
        gguf_model_dir(tmp_path / "x.gguf")
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)
