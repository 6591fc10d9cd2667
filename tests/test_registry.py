"""One model registry (forwardpass/registry.py): every kind listed by `forwardpass models`, every listed name
accepted by the commands of its kind, GGUF files served (`serve --model file.gguf`, `serve file.gguf`), an
empty --model refused by name, and /v1/models listing what the server runs."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from forwardpass.cli import main
from forwardpass.errors import ModelNotFoundError, ValidationError
from forwardpass.registry import KINDS, list_models, resolve_model
from tests.helpers.server import ServerProcess


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    """The embedded model written as a float32 GGUF file by our converter (scripts/to_gguf.py)."""
    from forwardpass.assets import default_llm_path
    from tests.helpers.gguf_files import converter

    out = tmp_path_factory.mktemp("gguf") / "embedded-f32.gguf"
    converter().convert(default_llm_path(), out, "f32")
    return out


def test_models_lists_every_kind(capsys):
    assert main(["models", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["models"]
    embedded = {r["model"]: r["type"] for r in rows if r["source"] == "embedded"}
    assert embedded == {"forwardpass-default": "text", "forwardpass-default-draft": "text", "digits": "image",
                        "moving-digits": "video", "forwardpass-speech": "speech"}
    assert {r["type"] for r in rows} <= set(KINDS)
    assert all(Path(r["path"]).exists() for r in rows)
    assert main(["models"]) == 0  # the table names each kind
    table = capsys.readouterr().out
    assert all(f"{kind} (embedded)" in table for kind in ("text", "image", "video", "speech"))


def test_every_listed_name_resolves_for_its_kind():
    for m in list_models():
        if m.source in ("embedded", "package"):
            got = resolve_model(m.name, kinds=(m.kind,))
            assert got.is_dir() and ((got / "config.json").is_file() or (got / "model_index.json").is_file())


def test_a_name_of_another_kind_names_the_command_that_runs_it():
    with pytest.raises(ValidationError, match="embedded image model; run it with forwardpass image"):
        resolve_model("digits")  # generate / chat / serve take text (and speech) models
    with pytest.raises(ValidationError, match="embedded video model"):
        resolve_model("moving-digits")


@pytest.mark.parametrize("argv", [["generate", "hi", "--model", ""], ["chat", "--model", " "],
                                  ["serve", "--model", ""], ["explain", "hi", "--model", ""],
                                  ["serve", ""], ["image", "a 7", "--model", ""]])
def test_an_empty_model_is_an_error_naming_the_flag(argv, capsys):
    """`serve --model "$(cmd)"` whose substitution printed nothing must not serve the default LLM."""
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "--model is empty" in err and err.count("\n") == 1


def test_serve_with_two_different_models_says_to_give_one(capsys):
    assert main(["serve", "smollm2", "--model", "forwardpass-default"]) == 1
    assert "give one, as `forwardpass serve MODEL`" in capsys.readouterr().err


def test_roofline_takes_the_names_the_commands_take(capsys, gguf_file):
    assert main(["roofline", "forwardpass-default", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc and "Qwen3ForCausalLM" in json.dumps(doc)
    assert main(["roofline", str(gguf_file), "--json"]) == 0
    assert "Qwen3ForCausalLM" in capsys.readouterr().out
    with pytest.raises(ModelNotFoundError, match="not in the Hugging Face cache"):
        resolve_model("acme/not-downloaded-anywhere", download=False)


def test_serve_model_gguf_file_passes_every_start_up_check(gguf_file, monkeypatch):
    """`serve --model file.gguf`: the GGUF's model directory is accepted (no "expected model.safetensors"),
    served under the file's name; the server itself is replaced by a recorder."""
    from forwardpass.server import run as server_run

    seen = {}

    def fake_run_server(spec, server_config, **kwargs):
        seen.update(spec=spec, config=server_config)
        kwargs["sockets"][0].close()

    monkeypatch.setattr(server_run, "run_server", fake_run_server)
    assert main(["serve", "--model", str(gguf_file), "--port", "0", "--threads", "1"]) == 0
    assert list(seen["config"].models) == ["embedded-f32"]
    assert (Path(seen["spec"].model) / "gguf.json").is_file() and seen["spec"].num_threads == 1


def test_serve_gguf_positional_and_v1_models_lists_what_it_runs(gguf_file):
    """vLLM's `serve MODEL` form with a .gguf file; /v1/models lists the LLM and the image / video models."""
    srv = ServerProcess(gguf_file, "--image-model", "default", "--video-model", "default", "--threads", "1",
                        startup_timeout=300)
    at = srv.cmd.index("--model")
    srv.cmd[at:at + 2] = [str(gguf_file)]  # positional
    at = srv.cmd.index("--served-model-name")
    del srv.cmd[at:at + 2]  # the default served name: the file's
    with srv:
        models = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] == ["embedded-f32", "digits", "moving-digits"]
        assert [m["forwardpass"].get("kind") for m in models[1:]] == ["image", "video"]
        r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "model": "embedded-f32", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
