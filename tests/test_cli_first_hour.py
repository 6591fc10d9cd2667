"""Small things a new user meets in the first hour (issue 22): --version, - as stdin, random seeds by
default, a closed pipe, --device on every generating command."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from forwardpass.cli import build_parser, main
from tests.helpers.server import REPO


def test_version(capsys):
    import forwardpass

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == ("forwardpass "
                                                                             f"{forwardpass.__version__}")


def test_device_flag_on_every_generating_command(capsys):
    parser = build_parser()
    for argv in (["generate", "hi"], ["chat"], ["image", "seven"], ["serve"], ["explain", "hi"]):
        assert parser.parse_args([*argv, "--device", "cpu"]).device == "cpu"
    assert main(["generate", "hi", "--device", "cuda:7"]) == 1
    assert "cuda:7" in capsys.readouterr().err


def test_random_seed_by_default_when_sampling():
    from forwardpass.commands._common import sampling_params_from_args

    class Engine:
        @staticmethod
        def default_sampling_params():
            from forwardpass.sampling.params import SamplingParams

            return SamplingParams(temperature=0.8)

    args = argparse.Namespace(temperature=None, top_k=None, top_p=None, min_p=None, repetition_penalty=None,
                              max_tokens=8, seed=None, stop=None, ignore_eos=False)
    seeds = {sampling_params_from_args(Engine, args).seed for _ in range(5)}
    assert None not in seeds and len(seeds) > 1  # vLLM's default: a fresh seed per request
    args.seed = 7
    assert sampling_params_from_args(Engine, args).seed == 7
    args.seed, args.temperature = None, 0.0
    assert sampling_params_from_args(Engine, args).seed is None  # greedy needs none
    assert "random seed" in build_parser()._subparsers._group_actions[0].choices["generate"].format_help()


def test_prompt_from_stdin():
    r = subprocess.run([sys.executable, "-m", "forwardpass.cli", "generate", "-", "--max-tokens", "2",
                        "--temperature", "0"], input="Once upon a time", capture_output=True, text=True,
                       check=False, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Once upon a time")


def test_closed_pipe_is_not_a_traceback():
    r = subprocess.run(f"{sys.executable} -m forwardpass.cli roofline llama-3-8b --json | true",
                       shell=True, capture_output=True, text=True, check=False, cwd=REPO, timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr


def test_bench_serve_names_an_http_error(capsys):
    """A 401 is "the server answered HTTP 401", not "cannot reach the server"."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Refuse(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(401)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        assert main(["bench", "serve", "--base-url", url, "--num-prompts", "1", "--no-progress"]) == 1
    finally:
        srv.shutdown()
    err = capsys.readouterr().err
    assert "answered HTTP 401" in err and "--api-key" in err and "cannot reach" not in err


def test_a_kernel_build_shows_progress_on_a_terminal_and_one_line_in_logs(caplog):
    """A one-time compile is a wait a person notices: a live bar with the elapsed time on a terminal."""
    pexpect = pytest.importorskip("pexpect")
    code = ("import logging, time; from forwardpass.kernel_build import compile_progress\n"
            "with compile_progress('the test kernel', 30, logging.getLogger('t')): time.sleep(1.5)\n"
            "print('built')")
    child = pexpect.spawn(sys.executable, ["-c", code], encoding="utf-8", timeout=60, dimensions=(24, 120))
    child.expect("compiling the test kernel")
    child.expect(r"0:00:0\d")  # the elapsed-time column
    child.expect("built")
    child.close()

    from forwardpass.kernel_build import compile_progress  # not a terminal: one log line

    with caplog.at_level("WARNING"), compile_progress("the test kernel", 30,
                                                      __import__("logging").getLogger("t")):
        pass
    assert [r.getMessage() for r in caplog.records] == ["compiling the test kernel (once, ~30 s; cached "
                                                        "afterwards)"]


def test_two_checkouts_build_their_kernels_apart(tmp_path):
    """The build files name the source's path: two checkouts of the same code sharing one cache folder must
    not share a build (each would rebuild it whenever the other had, ~1 min per switch); the
    same checkout reuses it."""
    from forwardpass.kernel_build import CppKernel

    a, b = tmp_path / "a" / "k.cpp", tmp_path / "b" / "k.cpp"
    for src in (a, b):
        src.parent.mkdir()
        src.write_text("// the same code\n")
    before = CppKernel("k", a, ("-O3",)).build_name
    assert before != CppKernel("k", b, ("-O3",)).build_name
    assert before == CppKernel("k", a, ("-O3",)).build_name
    a.write_text("// changed code\n")  # and a changed source still gets a build of its own
    assert CppKernel("k", a, ("-O3",)).build_name != before
