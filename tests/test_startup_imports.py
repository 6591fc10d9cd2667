"""What a CLI command imports before its first output: nothing it does not use (issue 57's start-up).

Each command runs in a fresh interpreter, as a user starts it; at exit the process lists which of the heavy
modules it loaded. Counted, not timed: a busy machine changes the seconds, not the modules. The ones named
here cost seconds each (transformers, scipy.signal, torch._dynamo with sympy and triton: that one came from
ops run on the meta device), and none is needed to generate text or transcribe a clip.
"""

from __future__ import annotations

import json
import subprocess
import sys
import wave

import numpy as np

from tests.helpers.server import REPO

NOT_FOR_GENERATE = ("transformers", "diffusers", "scipy", "matplotlib", "fastapi", "uvicorn", "starlette",
                    "torch._dynamo", "sympy", "triton", "sklearn", "xgrammar", "PIL", "prompt_toolkit",
                    "huggingface_hub", "prometheus_client", "httpx", "gguf")
NOT_FOR_TRANSCRIBE = ("transformers", "diffusers", "scipy", "matplotlib", "fastapi", "uvicorn", "starlette",
                      "torch._dynamo", "sympy", "triton", "sklearn", "xgrammar", "prompt_toolkit")

# runs the CLI, then prints (last line) the watched modules it loaded
RUN = """
import atexit, json, sys
WATCH = json.loads(sys.argv.pop(1))
atexit.register(lambda: print("\\nLOADED " + json.dumps([m for m in WATCH if m in sys.modules])))
from forwardpass.cli import main
sys.exit(main(sys.argv[1:]))
"""


def loaded(watch: tuple[str, ...], *argv: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", RUN, json.dumps(watch), *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("LOADED "), done.stdout
    return json.loads(last.removeprefix("LOADED "))


def test_parsing_a_command_imports_no_torch():
    code = ("import sys; from forwardpass.cli import build_parser; "
            "build_parser().parse_args(['generate', 'Hi']); "
            "print([m for m in ('torch', 'numpy', 'rich', 'pydantic') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr


def test_generate_imports_neither_the_server_nor_the_oracles():
    watch = (*NOT_FOR_GENERATE, "torch", "tokenizers")  # the two it does need: the check does see imports
    got = loaded(watch, "generate", "Hi", "--max-tokens", "1")
    assert "torch" in got and "tokenizers" in got
    assert not set(got) & set(NOT_FOR_GENERATE), got


def test_transcribing_a_22khz_clip_imports_no_scipy(tmp_path):
    clip = tmp_path / "tone.wav"
    rate = 22_050  # espeak-ng's rate: resampled to 16 kHz first
    samples = (0.3 * np.sin(2 * np.pi * 440 * np.arange(rate) / rate) * 32767).astype(np.int16)
    with wave.open(str(clip), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.tobytes())
    watch = (*NOT_FOR_TRANSCRIBE, "torch")
    got = loaded(watch, "transcribe", str(clip))  # the embedded speech model
    assert "torch" in got
    assert not set(got) & set(NOT_FOR_TRANSCRIBE), got
