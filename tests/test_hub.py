"""Hugging Face ids resolved through a local cache laid out as huggingface_hub writes it (issue 22):
``$HF_HOME/hub/models--ORG--NAME/{blobs,refs,snapshots}``, snapshot files symlinked to blobs."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from forwardpass.assets import default_llm_path
from forwardpass.cli import main
from forwardpass.errors import ModelNotFoundError
from forwardpass.loader.hub import cached_models
from forwardpass.registry import resolve_model_path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    home = tmp_path / "hf"
    repo = home / "hub" / "models--acme--tiny-qwen"
    snap = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in default_llm_path().iterdir():
        if f.is_file():
            digest = hashlib.sha256(f.read_bytes()).hexdigest()
            shutil.copyfile(f, repo / "blobs" / digest)
            (snap / f.name).symlink_to(f"../../blobs/{digest}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "refs" / "v1").write_text(COMMIT)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # never touch the network in tests
    return home


def test_id_resolves_to_the_cached_snapshot(hf_home):
    path = resolve_model_path("acme/tiny-qwen")
    assert path.name == COMMIT and (path / "config.json").is_file()
    assert resolve_model_path("acme/tiny-qwen", revision="v1") == path
    assert resolve_model_path("acme/tiny-qwen", revision=COMMIT) == path


def test_llm_and_cli_accept_an_id(hf_home, capsys):
    from forwardpass import LLM, SamplingParams

    llm = LLM("acme/tiny-qwen", num_kv_blocks=64)
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(out.outputs[0].token_ids) == 4
    from forwardpass.commands._common import resolve_model

    assert resolve_model("acme/tiny-qwen") == str(llm.engine.model_dir)  # what generate / chat / serve load


def test_missing_model_offline_is_one_line(hf_home, capsys):
    with pytest.raises(ModelNotFoundError, match="not in the Hugging Face cache .* HF_HUB_OFFLINE"):
        resolve_model_path("acme/other")
    with pytest.raises(ModelNotFoundError, match="not in the Hugging Face cache"):
        resolve_model_path("acme/tiny-qwen", revision="v2")
    assert main(["generate", "hi", "--model", "acme/other"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: acme/other is not in the Hugging Face cache")
    assert main(["serve", "--model", "acme/other", "--port", "0"]) == 1
    assert capsys.readouterr().err.count("\n") == 1


def test_paths_are_not_ids(tmp_path, hf_home):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model_path(tmp_path / "nope" / "deeper")
    with pytest.raises(ModelNotFoundError, match="--revision"):
        resolve_model_path(default_llm_path(), revision="main")


def test_models_command_lists_cache_and_embedded(hf_home, capsys):
    [m] = cached_models()
    assert m.repo_id == "acme/tiny-qwen" and m.architecture == "Qwen3ForCausalLM" and m.size_bytes > 1e6
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "acme/tiny-qwen" in out and "forwardpass-default" in out and "digits" in out
    assert main(["models", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["models"]
    packaged = {r["model"] for r in rows if r["kind"].endswith("(package)")}  # pip-installed models, if any
    assert {r["model"] for r in rows} - packaged == {"forwardpass-default", "forwardpass-default-draft",
                                                      "digits", "moving-digits", "forwardpass-speech",
                                                      "acme/tiny-qwen"}
