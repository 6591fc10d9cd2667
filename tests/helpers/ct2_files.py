"""CTranslate2 ``model.bin`` files written by hand (the layout of ``forwardpass/loader/ctranslate2.py``), for
tests of what the reader refuses: another spec, a truncated file, a dtype it does not read."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

DTYPE_IDS = {
    np.dtype("float32"): 0,
    np.dtype("int8"): 1,
    np.dtype("int16"): 2,
    np.dtype("int32"): 3,
    np.dtype("float16"): 4,
}


def _string(text: str) -> bytes:
    raw = text.encode() + b"\0"
    return struct.pack("<H", len(raw)) + raw


def model_bin(
    spec: str,
    variables: dict[str, np.ndarray],
    aliases: dict[str, str] | None = None,
    revision: int = 3,
    version: int = 6,
    dtype_ids: dict[str, int] | None = None,
) -> bytes:
    """The bytes of a model.bin; ``dtype_ids`` overrides a variable's dtype id (an id the reader does not
    know)."""
    out = [
        struct.pack("<I", version),
        _string(spec),
        struct.pack("<I", revision),
        struct.pack("<I", len(variables)),
    ]
    for name, value in variables.items():
        value = np.ascontiguousarray(value)
        out += [_string(name), struct.pack("<B", value.ndim), *(struct.pack("<I", d) for d in value.shape)]
        dtype_id = (dtype_ids or {}).get(name, DTYPE_IDS[value.dtype])
        out += [struct.pack("<B", dtype_id), struct.pack("<I", value.nbytes), value.tobytes()]
    out.append(struct.pack("<I", len(aliases or {})))
    for alias, name in (aliases or {}).items():
        out += [_string(alias), _string(name)]
    return b"".join(out)


def write_dir(path: Path, data: bytes, config: dict | None = None) -> Path:
    """A CTranslate2-style directory: ``model.bin`` and a config.json without ``architectures``."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "model.bin").write_bytes(data)
    (path / "config.json").write_text(json.dumps(config or {"suppress_ids": [], "lang_ids": []}))
    return path
