"""CTranslate2 Whisper directories (faster-whisper's format): a random-weight transformers Whisper converted
by CTranslate2's own converter loads into the same weights (float32 exactly; float16, bfloat16 and int8 within
their rounding) and greedy-decodes exactly as transformers does on the original; the directory is recognised
by its files wherever a model is named; ``quantization="int8"`` quantizes its float16 / int8 weights to our
Q8_0 blocks once at load; and a model.bin of another spec, a truncated one and one with a dtype we do not read
are each refused with one error before any model is built."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from forwardpass import LLM, SamplingParams
from forwardpass.errors import ConfigError, CorruptWeightsError
from forwardpass.loader import ctranslate2 as ct2
from forwardpass.models.loading import load_model
from forwardpass.models.whisper_ct2 import load_ctranslate2_whisper
from forwardpass.registry import resolve_model_path
from tests.helpers.ct2_files import model_bin, write_dir
from tests.helpers.whisper_checkpoints import hf_greedy, make_clip, make_whisper_checkpoint, prompt_ids

pytest.importorskip("transformers")
ctranslate2 = pytest.importorskip("ctranslate2")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # converted directories go here


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A random Whisper (biases and norms randomised too) and its CTranslate2 conversions."""
    root = tmp_path_factory.mktemp("ct2")
    hf = make_whisper_checkpoint(root / "hf", 80, 100, seed=5)
    from transformers import WhisperForConditionalGeneration

    model = WhisperForConditionalGeneration.from_pretrained(hf)
    with torch.no_grad():  # transformers initialises biases to 0 and norms to 1: make every mapping visible
        gen = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if name.endswith("bias") or "layer_norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
    model.save_pretrained(hf)
    out = {"hf": hf}
    for q in ("float32", "float16", "bfloat16", "int8"):
        conv = ctranslate2.converters.TransformersConverter(str(hf), copy_files=["tokenizer.json"])
        out[q] = conv.convert(str(root / q), quantization=q, force=True)
    return out


def _state(path) -> dict[str, torch.Tensor]:
    return {
        k: v.float() for k, v in load_ctranslate2_whisper(resolve_model_path(path))[0].state_dict().items()
    }


def test_weights_map_back_exactly(converted):
    want = load_model(converted["hf"])[0].state_dict()
    got = _state(converted["float32"])
    assert set(got) == set(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name  # q/k/v and cross k/v un-fused, conv, norms, positions
    for q, dtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        got = _state(converted[q])
        for name, value in want.items():
            assert torch.equal(got[name], value.to(dtype).float()), (q, name)
    got = _state(converted["int8"])  # per-row int8 with a scale: within half a step of each row's scale
    for name, value in want.items():
        step = (
            value.abs().amax(dim=tuple(range(1, value.dim())), keepdim=True) / 127 if value.dim() > 1 else 0
        )
        assert (got[name] - value).abs().le(step / 2 + 1e-6).all(), name


def test_greedy_equals_transformers_on_the_original(converted):
    from transformers import WhisperForConditionalGeneration

    hf = WhisperForConditionalGeneration.from_pretrained(converted["hf"]).eval()
    llm = LLM(str(converted["float32"]), max_num_seqs=2, num_kv_blocks=64)  # the CTranslate2 directory itself
    assert (
        llm.engine.core.plan.checkpoint_format == "ctranslate2"
        and (llm.engine.model_dir / ct2.MARKER).is_file()
    )
    prompt = prompt_ids(converted["hf"])
    from forwardpass.audio import log_mel_spectrogram

    for seed in (1, 2):
        clip = make_clip(0.7, seed)
        got = llm.generate(
            {"prompt_token_ids": prompt, "multi_modal_data": {"audio": (clip, 16_000)}},
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            use_tqdm=False,
        )
        want = hf_greedy(hf, log_mel_spectrogram(clip, 80, 200), prompt, 12)
        assert list(got[0].outputs[0].token_ids) == want
    llm.engine.check_invariants()


def test_directory_is_recognised_and_configured(converted):
    src = Path(converted["float16"])
    assert ct2.is_ctranslate2_dir(src) and not ct2.is_ctranslate2_dir(converted["hf"])
    made = resolve_model_path(src)
    assert resolve_model_path(src) == made  # made once, then reused
    config = json.loads((made / "config.json").read_text())
    hf_config = json.loads((converted["hf"] / "config.json").read_text())
    for key in (
        "d_model",
        "encoder_layers",
        "decoder_layers",
        "encoder_attention_heads",
        "decoder_ffn_dim",
        "max_source_positions",
        "max_target_positions",
        "num_mel_bins",
        "vocab_size",
    ):
        assert config[key] == hf_config[key], key
    generation = json.loads((made / "generation_config.json").read_text())
    ct2_config = json.loads((src / "config.json").read_text())
    assert generation["suppress_tokens"] == (ct2_config["suppress_ids"] or [])
    assert generation["begin_suppress_tokens"] == (ct2_config["suppress_ids_begin"] or [])
    assert generation["alignment_heads"] == [list(h) for h in ct2_config["alignment_heads"]]
    assert generation["is_multilingual"] is False  # a vocabulary under 51865 tokens (the tiny test tokenizer)


# ----- refusals: one error each, before any model is built
# -------------------------------------------------------
@pytest.fixture
def no_build(monkeypatch):
    """Fail the test if a model were built (and so allocated) before the error."""
    import forwardpass.models.loading as loading

    def refuse(*a, **k):
        raise AssertionError("a model was built before the bad file was refused")

    monkeypatch.setattr(loading, "build_model", refuse)


def _variables() -> dict[str, np.ndarray]:
    return {
        "decoder/embeddings/weight": np.zeros((8, 4), np.float16),
        "decoder/num_heads": np.array(2, np.int16),
    }


def test_another_spec_is_refused(tmp_path, no_build):
    path = write_dir(tmp_path / "marian", model_bin("TransformerSpec", _variables(), revision=7))
    with pytest.raises(ConfigError, match="TransformerSpec model; forwardpass reads CTranslate2 Whisper"):
        LLM(str(path))
    assert not (tmp_path / "cache").exists()  # no model directory was made for it


def test_truncated_file_is_refused(tmp_path, converted, no_build):
    data = (Path(converted["float16"]) / "model.bin").read_bytes()
    for cut in (len(data) // 2, 3, 0):
        path = write_dir(tmp_path / f"cut{cut}", data[:cut])
        with pytest.raises(CorruptWeightsError, match="truncated|empty"):
            resolve_model_path(path)


def test_unknown_dtype_is_refused(tmp_path, no_build):
    data = model_bin("WhisperSpec", _variables(), dtype_ids={"decoder/embeddings/weight": 9})
    path = write_dir(tmp_path / "odd", data)
    with pytest.raises(ConfigError, match="dtype id 9, which forwardpass does not read"):
        resolve_model_path(path)


def test_incomplete_whisper_is_refused(tmp_path, converted, no_build):
    path = write_dir(tmp_path / "partial", model_bin("WhisperSpec", _variables()))
    shutil.copy(Path(converted["float16"]) / "tokenizer.json", path)
    with pytest.raises(ConfigError, match="lacks encoder/conv1/weight"):
        resolve_model_path(path)


@pytest.mark.parametrize("source", ["float16", "int8"])
def test_ct2_whisper_quantized_at_load(converted, source):
    """CTranslate2's float16 (and int8) files → our Q8_0 blocks, quantized once at load from the values the
    fp32 load reads: every projection and the tied LM head hold exactly ``QuantizedWeight.from_float`` of
    the fp32 model's weight; convolutions, position embeddings and norms stay fp32; the engine decodes."""
    from forwardpass.layers.embedding import TokenEmbedding
    from forwardpass.layers.linear import Linear
    from forwardpass.layers.weight_methods import method_for
    from forwardpass.quant.weight import QuantizedWeight

    fp32 = load_ctranslate2_whisper(resolve_model_path(converted[source]))[0]
    llm = LLM(str(converted[source]), max_num_seqs=2, num_kv_blocks=64, quantization="int8")
    plan = llm.engine.core.plan
    assert plan.checkpoint_format == "ctranslate2" and method_for(plan, "projection").name == "q8_0"
    model, dense = llm.engine.model, dict(fp32.named_modules())
    held = [(n, m) for n, m in model.named_modules() if isinstance(m, (Linear, TokenEmbedding))]
    assert len(held) == 2 * 6 + 2 * 10 + 1  # 2 encoder layers x 6, 2 decoder layers x 10, the tied head
    for name, m in held:
        assert isinstance(m.weight, QuantizedWeight) and m.weight.fmt == "q8_0", name
        want = QuantizedWeight.from_float(dense[name].weight, "q8_0").dequantize()
        assert torch.equal(m.weight.dequantize(), want), name
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    for name in ("model.encoder.conv1", "model.encoder.embed_positions", "model.decoder.layer_norm"):
        assert isinstance(model.get_submodule(name).weight, torch.nn.Parameter), name
    prompt = prompt_ids(converted["hf"])
    out = llm.generate(
        {"prompt_token_ids": prompt, "multi_modal_data": {"audio": (make_clip(0.7, 1), 16_000)}},
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.token_ids) == 8
    assert all(np.isfinite(next(iter(s.values())).logprob) for s in out.logprobs)
    llm.engine.check_invariants()
