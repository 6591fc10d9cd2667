"""Model-directory loader: weights, tokenizer, chat template, streaming detokenizer, generation defaults.

transformers is the oracle: every parity test loads the same directory with it and compares.
"""

from __future__ import annotations

import itertools
import json
import pickle
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from jinja2.sandbox import SecurityError

from forwardpass.errors import (
    ChatTemplateError,
    CorruptWeightsError,
    MissingFileError,
    MissingTensorError,
    ModelLoadError,
    ModelNotFoundError,
    TokenizerError,
    UnsafeCheckpointError,
    WeightShapeError,
)
from forwardpass.loader.config import load_model_config
from forwardpass.loader.detokenizer import _WINDOW, _SpaceCleanupStream
from forwardpass.loader.generation_config import GenerationDefaults, load_generation_config
from forwardpass.loader.tokenizer import IncrementalDetokenizer, Tokenizer, _clean_up_tokenization
from forwardpass.loader.weights import WeightSource, find_weight_files, load_into
from forwardpass.models.model_spec import ModelSpec
from tests.helpers.tokenizer_factory import CHATML_TEMPLATE, make_test_tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world",
    " leading space and  double  spaces",
    "café, été, crème brûlée",
    "日本語のテスト 北京",
    "emoji 😀🎉 👍🏽 🦄 ok",
    "rare ♥ 𝔘 Ω ∑ ß",
    "line one\nline two\n\n\tindented",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]


# ----- fixtures ---------------------------------------------------------------------------------
def _tiny_llama(dtype=torch.float32):
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(dtype).eval()


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory):
    model = _tiny_llama()
    path = tmp_path_factory.mktemp("sharded")
    model.save_pretrained(path, max_shard_size="50KB")
    return path, model


@pytest.fixture(scope="module")
def single_dir(tmp_path_factory):
    model = _tiny_llama()
    path = tmp_path_factory.mktemp("single")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["bytelevel", "llama"])
def tok_dir(request, tmp_path_factory):
    return make_test_tokenizer(tmp_path_factory.mktemp(request.param), request.param, vocab_size=512)


@pytest.fixture(scope="module")
def bytelevel_dir(tmp_path_factory):
    return make_test_tokenizer(tmp_path_factory.mktemp("bl"), "bytelevel", vocab_size=512)


def _copy_without(src: Path, dst: Path, skip: set[str]) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in skip:
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


# ----- bad directories: each error names the problem -------------------------------------------
def test_nonexistent_path(tmp_path):
    missing = tmp_path / "nope"
    for load in (load_model_config, WeightSource.from_dir, Tokenizer.from_dir):
        with pytest.raises(ModelNotFoundError, match="does not exist"):
            load(missing)


def test_missing_config_json(tmp_path):
    with pytest.raises(MissingFileError, match="config.json"):
        load_model_config(tmp_path)


def test_malformed_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{ not json")
    with pytest.raises(ModelLoadError, match=r"config.json is not valid JSON"):
        load_model_config(tmp_path)


def test_pickle_only_checkpoint_is_refused_without_unpickling(tmp_path, monkeypatch):
    torch.save({"w": torch.zeros(2)}, tmp_path / "pytorch_model.bin")

    def forbidden(*args, **kwargs):
        raise AssertionError("a pickle checkpoint was unpickled")

    for target, name in [(pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")]:
        monkeypatch.setattr(target, name, forbidden)
    with pytest.raises(UnsafeCheckpointError) as info:
        WeightSource.from_dir(tmp_path)
    msg = str(info.value)
    assert "pytorch_model.bin" in msg and "never unpickled" in msg and "safe_serialization=True" in msg


def test_no_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(MissingFileError) as info:
        find_weight_files(tmp_path)
    assert str(tmp_path) in str(info.value) and "save_pretrained" in str(info.value)


def _corruptions(data: bytes) -> dict[str, bytes]:
    header_len = int.from_bytes(data[:8], "little")
    return {
        "cut_in_data": data[: len(data) - 100],
        "cut_in_header": data[: 8 + header_len // 2],
        "only_length_field": data[:8],
        "empty": b"",
        "garbage": b"this is not a safetensors file at all" * 10,
        "bad_header_json": data[:8] + b"\xff" * header_len + data[8 + header_len :],
        "huge_header_length": (2**40).to_bytes(8, "little") + data[8:],
    }


@pytest.mark.parametrize("kind", list(_corruptions(b"\0" * 64)))
def test_corrupt_safetensors(single_dir, tmp_path, kind):
    data = (single_dir / "model.safetensors").read_bytes()
    broken = _copy_without(single_dir, tmp_path, {"model.safetensors"}) / "model.safetensors"
    broken.write_bytes(_corruptions(data)[kind])
    with pytest.raises(CorruptWeightsError) as info:
        WeightSource.from_dir(tmp_path)
    assert "model.safetensors" in str(info.value)


def test_truncated_safetensors_says_truncated(single_dir, tmp_path):
    data = (single_dir / "model.safetensors").read_bytes()
    d = _copy_without(single_dir, tmp_path, {"model.safetensors"})
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptWeightsError, match="truncated"):
        WeightSource.from_dir(d)


def test_index_names_missing_shard(sharded_dir, tmp_path):
    src, _ = sharded_dir
    shards = sorted(f.name for f in src.glob("*.safetensors"))
    d = _copy_without(src, tmp_path, {shards[-1]})
    with pytest.raises(MissingFileError) as info:
        WeightSource.from_dir(d)
    assert shards[-1] in str(info.value) and "model.safetensors.index.json" in str(info.value)


def test_missing_tensor_names_it_and_suggests(single_dir):
    source = WeightSource.from_dir(single_dir)
    with pytest.raises(MissingTensorError) as info:
        source.get("model.layers.0.self_attn.q_proj.weights")
    msg = str(info.value)
    assert "model.layers.0.self_attn.q_proj.weights" in msg and str(single_dir) in msg
    assert "model.layers.0.self_attn.q_proj.weight" in msg.split("closest names:")[1]
    assert "nope" not in source and "model.norm.weight" in source


def test_wrong_shape_via_load_into(single_dir):
    source = WeightSource.from_dir(single_dir)
    param = torch.nn.Parameter(torch.empty(64, 32))  # the checkpoint's q_proj is (32, 32)
    with pytest.raises(WeightShapeError) as info:
        load_into(param, source, "model.layers.0.self_attn.q_proj.weight")
    msg = str(info.value)
    assert (
        "q_proj" in msg
        and "(64, 32)" in msg
        and "(32, 32)" in msg
        and "does config.json match the weights?" in msg
    )


def test_missing_tokenizer_json(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerError, match="tokenizer.json is missing"):
        Tokenizer.from_dir(tmp_path)


def test_broken_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "Nonsense"}}')
    with pytest.raises(TokenizerError, match="tokenizer.json could not be loaded"):
        Tokenizer.from_dir(tmp_path)


# ----- weights ----------------------------------------------------------------------------------
def test_sharded_checkpoint_matches_hf(sharded_dir):
    path, model = sharded_dir
    source = WeightSource.from_dir(path)
    assert (path / "model.safetensors.index.json").is_file() and len(source.files) >= 3
    state = model.state_dict()
    assert sorted(source.keys()) == sorted(state)
    for name, ref in state.items():
        assert source.shape(name) == tuple(ref.shape)
        assert torch.equal(source.get(name), ref), name


def test_bf16_checkpoint_loads_into_fp32(tmp_path):
    model = _tiny_llama(torch.bfloat16)
    model.save_pretrained(tmp_path)
    source = WeightSource.from_dir(tmp_path)
    name = "model.layers.1.mlp.up_proj.weight"
    assert source.dtype(name) == torch.bfloat16
    param = torch.nn.Parameter(torch.empty(source.shape(name), dtype=torch.float32))
    load_into(param, source, name)
    assert param.dtype == torch.float32 and torch.equal(param.data, model.state_dict()[name].float())


def test_load_into_with_transform(single_dir):
    source = WeightSource.from_dir(single_dir)
    name = "model.layers.0.mlp.gate_proj.weight"  # (64, 32): take the second half of the rows, as TP does
    half = torch.empty(32, 32)
    load_into(half, source, name, transform=lambda t: t[32:])
    assert torch.equal(half, source.get(name)[32:])
    with pytest.raises(WeightShapeError, match="after transform"):
        load_into(torch.empty(64, 32), source, name, transform=lambda t: t[32:])


# ----- tokenizer parity with transformers -------------------------------------------------------
def _assert_parity(ours: Tokenizer, hf) -> None:
    assert ours.vocab_size == len(hf)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        hf.bos_token_id,
        hf.eos_token_id,
        hf.pad_token_id,
    )
    assert ours.all_special_ids >= set(hf.all_special_ids)
    for text in TEXTS:
        ids = hf(text)["input_ids"]
        assert ours.encode(text) == ids, text
        assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), (
                text
            )


def test_factory_tokenizer_parity(tok_dir):
    _assert_parity(Tokenizer.from_dir(tok_dir), transformers.AutoTokenizer.from_pretrained(tok_dir))


def test_llama_kind_adds_bos_and_uses_byte_fallback(tmp_path):
    tok = Tokenizer.from_dir(make_test_tokenizer(tmp_path, "llama", 400))
    ids = tok.encode("Hi 𝔘")
    assert ids[0] == tok.bos_token_id == 1 and tok.decode(ids) == "Hi 𝔘"
    assert any(tok.id_to_token(i).startswith("<0x") for i in ids)  # 𝔘 is not in the alphabet


@pytest.mark.parametrize("kind,bos", [("bytelevel", None), ("llama", "<s>")])
def test_pretrainedtokenizerfast_save_pretrained_parity(tmp_path, kind, bos):
    """A tokenizer wrapped and saved by transformers itself (chat template in chat_template.jinja)."""
    import tokenizers

    backend = tokenizers.Tokenizer.from_file(
        str(make_test_tokenizer(tmp_path / "src", kind) / "tokenizer.json")
    )
    if kind == "llama":
        backend.post_processor = tokenizers.processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
        )
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token="<|im_end|>",
        pad_token="<pad>",
        chat_template=CHATML_TEMPLATE,
    )
    hf.save_pretrained(tmp_path / "saved")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "saved")
    ours = Tokenizer.from_dir(tmp_path / "saved")
    _assert_parity(ours, hf)  # "<pad>" was not in the vocabulary: both add it as a new special token
    assert ours.chat_template == CHATML_TEMPLATE
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs) == hf.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )


def test_config_bos_eos_flags_are_ignored_and_dict_tokens_parse_like_hf(bytelevel_dir, tmp_path):
    d = _copy_without(bytelevel_dir, tmp_path, set())
    config = json.loads((d / "tokenizer_config.json").read_text())
    config.update(
        bos_token={
            "__type": "AddedToken",
            "content": "<|endoftext|>",
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        },
        add_bos_token=True,
        add_eos_token=True,
    )
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    ours, hf = Tokenizer.from_dir(d), transformers.AutoTokenizer.from_pretrained(d)
    assert ours.bos_token == "<|endoftext|>" and ours.bos_token_id == ours.token_to_id("<|endoftext|>")
    assert ours.encode("hi") == Tokenizer.from_dir(bytelevel_dir).encode("hi")  # tokenizer.json decides
    _assert_parity(ours, hf)


# ----- streaming detokenizer --------------------------------------------------------------------
def _stream(tok: Tokenizer, ids: list[int], skip: bool = True) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[5, 6, 7], skip_special_tokens=skip)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    return deltas, detok


def test_detokenizer_deltas_equal_full_decode(tok_dir):
    tok = Tokenizer.from_dir(tok_dir)
    for text in TEXTS:
        ids = tok.encode(text)
        for skip in (True, False):
            deltas, detok = _stream(tok, ids, skip)
            assert "".join(deltas) == detok.text == tok.decode(ids, skip_special_tokens=skip), text
            assert not any("\ufffd" in d for d in deltas), (text, deltas)


def test_detokenizer_holds_back_split_characters(bytelevel_dir):
    tok = Tokenizer.from_dir(bytelevel_dir)
    ids = tok.encode("日本 🦄 😀")
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some tokens really hold partial characters
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.add(i) for i in ids]
    assert "" in deltas and not any("\ufffd" in d for d in deltas)
    assert detok.flush() == "" and detok.text == "日本 🦄 😀"


def test_detokenizer_window_stays_small(bytelevel_dir):
    tok = Tokenizer.from_dir(bytelevel_dir)
    ids = tok.encode("Le café 日本語 😀 the quick brown fox. " * 60)
    expected = tok.decode(ids)
    seen = []
    original = tok.decode_raw
    tok.decode_raw = lambda window, **kw: (seen.append(len(window)), original(window, **kw))[1]
    deltas, _ = _stream(tok, ids)
    assert "".join(deltas) == expected and len(ids) > 500
    # O(1) work per token, not O(output length): the window grows past 2 * _WINDOW only while its
    # candidate start falls mid-character (byte-level tokens that straddle characters).
    assert max(seen) <= 4 * _WINDOW and sum(seen) / len(seen) <= 2 * _WINDOW


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_detokenizer_random_ids_property(tok_dir, data):
    tok = Tokenizer.from_dir(tok_dir)
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=40))
    skip = data.draw(st.booleans())
    deltas, detok = _stream(tok, ids, skip)
    assert "".join(deltas) == detok.text == tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=" .,!?'nmstvreax", max_size=40), cuts=st.lists(st.integers(0, 40), max_size=8))
def test_space_cleanup_stream_equals_whole_cleanup(text, cuts):
    stream = _SpaceCleanupStream(_clean_up_tokenization)
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    out = "".join(stream.push(text[a:b]) for a, b in itertools.pairwise(bounds)) + stream.flush()
    assert out == _clean_up_tokenization(text)


def test_wordpiece_cleanup_parity_and_streaming(tmp_path):
    """clean_up_tokenization_spaces applies to non-BPE tokenizers (transformers 5 skips it for BPE)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    from tests.helpers.tokenizer_factory import CORPUS

    backend = Backend(models.WordPiece(unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    backend.train_from_iterator([CORPUS], trainers.WordPieceTrainer(vocab_size=400, special_tokens=["[UNK]"]))
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", clean_up_tokenization_spaces=True
    )
    hf.save_pretrained(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = Tokenizer.from_dir(tmp_path)
    assert ours.cleans_up_spaces
    for text in ["Hello , world ! isn't it ? we're here .", "don't stop 's 'm", "a . b , c"]:
        ids = hf(text)["input_ids"]
        assert ours.decode(ids) == hf.decode(ids)
        deltas, detok = _stream(ours, ids)
        assert "".join(deltas) == detok.text == hf.decode(ids)


# ----- chat template ----------------------------------------------------------------------------
CONVERSATIONS = [
    [{"role": "user", "content": "Hi é 日本 😀"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi!", "tool_calls": None},
        {"role": "user", "content": "More"},
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chatml_template_matches_transformers(bytelevel_dir, messages, add_generation_prompt):
    ours = Tokenizer.from_dir(bytelevel_dir)
    hf = transformers.AutoTokenizer.from_pretrained(bytelevel_dir)
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_chat_template_with_tools_matches_transformers(bytelevel_dir):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Wetter für Zürich",
                "parameters": {"type": "object", "properties": {}},
            },
        }
    ]
    ours = Tokenizer.from_dir(bytelevel_dir)
    hf = transformers.AutoTokenizer.from_pretrained(bytelevel_dir)
    msgs = CONVERSATIONS[1]
    expected = hf.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    got = ours.apply_chat_template(msgs, tools=tools)
    assert got == expected and '"Wetter für Zürich"' in got  # tojson does not escape non-ASCII


def _with_template(src: Path, dst: Path, template) -> Tokenizer:
    d = _copy_without(src, dst, set())
    config = json.loads((d / "tokenizer_config.json").read_text())
    if template is None:
        config.pop("chat_template")
    else:
        config["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_dir(d)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{% set _ = messages.append({'role': 'x'}) %}ok",
        "{% set ns = namespace(__class__=1) %}ok",
    ],
)
def test_unsafe_template_is_stopped_by_the_sandbox(bytelevel_dir, tmp_path, template):
    from forwardpass.errors import TokenizerError
    from forwardpass.loader.chat_template import render_chat_template

    with pytest.raises(TokenizerError, match="chat template 'default' .* is refused: .*unsafe operation"):
        _with_template(bytelevel_dir, tmp_path, template)  # refused when the model loads
    with pytest.raises(ChatTemplateError, match="unsafe") as info:  # and by the sandbox at any render
        render_chat_template(template, [{"role": "user", "content": "hi"}])
    assert isinstance(info.value.__cause__, SecurityError)


def test_missing_chat_template(bytelevel_dir, tmp_path):
    tok = _with_template(bytelevel_dir, tmp_path, None)
    assert tok.chat_template is None
    with pytest.raises(ChatTemplateError, match=r"no chat_template.*generate\(\) with a raw prompt"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_errors_carry_the_jinja_message(bytelevel_dir, tmp_path):
    tok = Tokenizer.from_dir(bytelevel_dir)
    with pytest.raises(ChatTemplateError, match="unknown role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])
    broken = _with_template(bytelevel_dir, tmp_path / "a", "{% for m in messages %}{{ m.content }")
    with pytest.raises(ChatTemplateError, match="does not parse"):
        broken.apply_chat_template([{"role": "user", "content": "hi"}])


def test_named_template_list_and_variables(bytelevel_dir, tmp_path):
    templates = [
        {
            "name": "default",
            "template": "{{ bos_token }}|{{ eos_token }}|{{ strftime_now('%Y') | length }}|{{ flag }}",
        },
        {"name": "tool_use", "template": "tools:{{ tools | length }}"},
    ]
    tok = _with_template(bytelevel_dir, tmp_path, templates)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], flag="on") == "|<|im_end|>|4|on"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tools=[{"a": 1}]) == "tools:1"


# ----- generation_config.json -------------------------------------------------------------------
def test_generation_config_defaults_and_eos_union(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_generation_config(tmp_path) == GenerationDefaults(eos_token_ids=[2, 7])
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 9, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": True})
    )
    spec = ModelSpec.from_config({"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                                  "intermediate_size": 16, "vocab_size": 32, "eos_token_id": [2, 7]})
    got = load_generation_config(tmp_path, spec)
    assert got == GenerationDefaults(eos_token_ids=[9, 2, 7], temperature=0.6, top_p=0.9, top_k=20)


def test_generation_config_missing_everything(tmp_path):
    assert load_generation_config(tmp_path) == GenerationDefaults(eos_token_ids=[])


def test_malformed_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text("{ nope")
    with pytest.raises(ModelLoadError, match="generation_config.json"):
        load_generation_config(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"temperature": "hot"}')
    with pytest.raises(ModelLoadError, match="temperature"):
        load_generation_config(tmp_path)
