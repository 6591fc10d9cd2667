"""The vLLM-style Python API and CLI on a tiny checkpoint with a real tokenizer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from forwardpass import LLM, SamplingParams
from forwardpass.errors import (
    MissingTensorError,
    SamplingParamsError,
    UnsafeCheckpointError,
    UnsupportedArchitectureError,
    WeightShapeError,
)
from tests.helpers.tokenizer_factory import make_test_tokenizer


@pytest.fixture(scope="module")
def model_dir(checkpoint_factory, tmp_path_factory):
    src = checkpoint_factory("qwen3", eos_token_id=None)
    d = tmp_path_factory.mktemp("withtok")
    shutil.copytree(src, d, dirs_exist_ok=True)
    make_test_tokenizer(d, kind="bytelevel", vocab_size=512)
    return d


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, num_kv_blocks=128)


def test_text_prompts_and_outputs(llm):
    outs = llm.generate(["Once upon a time", "The quick brown fox"],
                        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    tok = llm.get_tokenizer()
    for prompt, out in zip(["Once upon a time", "The quick brown fox"], outs):
        assert out.prompt == prompt and out.prompt_token_ids == tok.encode(prompt)
        c = out.outputs[0]
        assert len(c.token_ids) == 10 and c.finish_reason == "length"
        assert c.text == tok.decode(c.token_ids)
    llm.engine.check_invariants()


def test_n_samples_and_seed(llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=1234, ignore_eos=True)
    a = llm.generate(["hello"], params, use_tqdm=False)[0]
    b = llm.generate(["hello", "other prompt in the batch"],
                     [params, SamplingParams(temperature=1.0, seed=5)], use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]  # same seed, same tokens
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1  # the n samples differ
    c = llm.generate(["hello"], SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=99, ignore_eos=True),
                     use_tqdm=False)[0]
    assert [x.token_ids for x in c.outputs] != [x.token_ids for x in a.outputs]


def test_stop_strings_and_stop_tokens(llm):
    base = llm.generate(["Once"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0]
    text, ids = base.outputs[0].text, base.outputs[0].token_ids
    stop = text[5:8]
    assert stop and stop in text
    out = llm.generate(["Once"], SamplingParams(temperature=0, max_tokens=20, stop=[stop]), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop and c.text == text[: text.index(stop)]
    out = llm.generate(["Once"], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[ids[3]]),
                       use_tqdm=False)[0]
    c = out.outputs[0]
    assert (c.finish_reason == "stop" and c.stop_reason == ids[3]
            and c.token_ids == ids[: ids.index(ids[3]) + 1])


def test_logprobs(llm):
    out = llm.generate(["Once"], SamplingParams(temperature=0, max_tokens=5, logprobs=3), use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids)
    for tok, lp in zip(c.token_ids, c.logprobs):
        assert tok in lp and lp[tok].rank == 1  # greedy picks the most likely token
        assert len(lp) == 3 and all(v.logprob <= 0 for v in lp.values())


def test_chat_uses_template(llm):
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=4),
                   use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    expected = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]),
                          add_special_tokens=False)
    assert out.prompt_token_ids == expected


def test_invalid_sampling_params():
    for kwargs in ({"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"min_p": 2}, {"max_tokens": 0}):
        with pytest.raises(SamplingParamsError):
            SamplingParams(**kwargs)


def test_unknown_architecture_lists_supported(model_dir, tmp_path):
    shutil.copytree(model_dir, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="GPTNeoXForCausalLM.*Qwen3ForCausalLM"):
        LLM(tmp_path)


def test_wrong_shape_and_missing_tensor(model_dir, tmp_path):
    shutil.copytree(model_dir, tmp_path / "a", dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (tmp_path / "a" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightShapeError, match="mlp"):
        LLM(tmp_path / "a")
    shutil.copytree(model_dir, tmp_path / "b", dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    cfg["num_hidden_layers"] += 1
    cfg["layer_types"] = cfg["layer_types"] + ["full_attention"]
    (tmp_path / "b" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MissingTensorError, match=r"layers\.3\."):
        LLM(tmp_path / "b")


def test_pickle_only_directory_refused(model_dir, tmp_path):
    shutil.copy(model_dir / "config.json", tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not really a pickle")
    with pytest.raises(UnsafeCheckpointError, match="never unpickled"):
        LLM(tmp_path)


def test_cli_generate_streams(model_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "forwardpass.cli", "generate", "Once upon a time", "--model", str(model_dir),
         "--max-tokens", "8", "--temperature", "0"],
        check=False, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Once upon a time")
    bad = subprocess.run([sys.executable, "-m", "forwardpass.cli", "generate", "x", "--model", str(model_dir),
                          "--top-p", "3"], check=False, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "top_p" in bad.stderr
