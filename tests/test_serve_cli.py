"""What ``forwardpass serve`` says (issue 22): start-up errors are one line with exit code 1, found before
the model loads; once up, a banner, one access-log line per request and the periodic throughput line."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
import torch

from forwardpass.assets import default_llm_path
from forwardpass.cli import main
from tests.helpers.server import ServerProcess


def _one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


@pytest.mark.parametrize("flags,match", [
    (["--port", "99999"], "not a TCP port"),
    (["--max-num-seqs", "0"], "max_num_seqs must be a positive integer"),
    (["--device", "tpu"], "tpu"),
    (["--dtype", "float8"], "unknown dtype"),
    (["--model", "/nonexistent/dir"], "does not exist"),
])  # fmt: skip
def test_startup_errors_are_one_line(capsys, flags, match):
    assert match in _one_line_error(capsys, ["serve", "--port", "0", *flags] if "--port" not in flags
                                    else ["serve", *flags])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA")
def test_cuda_on_a_cpu_machine_is_one_line(capsys):
    assert "CUDA is not available" in _one_line_error(capsys, ["serve", "--port", "0", "--device", "cuda"])


def test_unsupported_architecture_is_one_line(capsys, tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["FooForCausalLM"], "model_type": "foo"}')
    assert "'FooForCausalLM'" in _one_line_error(capsys, ["serve", "--port", "0", "--model", str(tmp_path)])


def test_port_in_use_is_found_before_loading(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        start = time.perf_counter()
        err = _one_line_error(capsys, ["serve", "--port", str(port)])
        assert "already in use" in err and time.perf_counter() - start < 5


def test_log_level_after_the_subcommand():
    from forwardpass.cli import build_parser

    args = build_parser().parse_args(["serve", "--log-level", "INFO"])
    assert args.log_level == "INFO"
    args = build_parser().parse_args(["--log-level", "DEBUG", "serve"])
    assert args.log_level == "DEBUG"


def test_banner_access_log_and_throughput_line(tmp_path):
    log = tmp_path / "serve.log"
    with ServerProcess(default_llm_path(), "--log-stats-interval", "1", "--engine-backend", "thread",
                       log_path=log) as srv:
        r = httpx.post(srv.url + "/v1/completions", timeout=60,
                       json={"model": "test-model", "prompt": "Once upon a time", "max_tokens": 16})
        assert r.status_code == 200
        time.sleep(2.5)
        text = srv.log()
    assert "serving 'test-model': Qwen3ForCausalLM" in text
    assert "parameters, computing in float32 on cpu" in text
    # what the weights really are
    weights = next(line for line in text.splitlines() if "weights     " in line)
    assert "projections: " in weights and "lm head: " in weights and "KV cache float32" in weights
    assert "KV cache" in text and "context 1024 tokens" in text and f"{srv.url}/v1" in text
    assert "chat page" in text
    assert '"POST /v1/completions HTTP/1.1" 200' in text  # the access log
    assert ("Avg prompt throughput" in text and "Avg generation throughput" in text
            and "KV cache usage" in text)


def test_model_without_weights_is_one_line(capsys, tmp_path):
    import shutil

    for f in default_llm_path().glob("*.json"):
        shutil.copy(f, tmp_path / f.name)
    assert "no weights" in _one_line_error(capsys, ["serve", "--port", "0", "--model", str(tmp_path)])
