"""A bounded walk over a GGUF file's header, before the ``gguf`` package's reader sees it.

A hostile or damaged file can lie in every number of its header: a string or array length of 2**63, a tensor
count larger than the file, a tensor whose offset points past the end or into another tensor's bytes, a type
id nothing knows, a shape whose product overflows. The ``gguf`` reader trusts those numbers (it slices and
loops over them), so a lie becomes an exception from deep inside numpy, minutes of looping, or a tensor read
from the wrong bytes. This walk checks every one against the bytes that remain in the file, reading nothing
but the header through a memory map (it allocates nothing in proportion to the numbers it reads), and refuses
the first lie with a ``ConfigError`` naming it and where it is.

The layout (llama.cpp's ``gguf.md``), little-endian::

    "GGUF" u32 version (2, 3); u64 n_tensors; u64 n_kv
    n_kv x (str key; u32 value_type; value)        str: u64 length, bytes; array: u32 type, u64 count, items
    n_tensors x (str name; u32 n_dims; n_dims x u64 dim; u32 ggml_type; u64 offset)
    padding to general.alignment (32), then the tensor data (each offset relative to its start, aligned)
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from forwardpass.errors import ConfigError

MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 1 << 16  # keys and tensor names: llama.cpp refuses longer ones too
MAX_ALIGNMENT = 1 << 16
MAX_TEXT_BYTES = 1 << 24  # one metadata string (a chat template is some KB)
#: value type id -> (name, byte size; 0 = variable: a string or an array)
_SCALARS = {0: ("uint8", 1), 1: ("int8", 1), 2: ("uint16", 2), 3: ("int16", 2), 4: ("uint32", 4),
            5: ("int32", 4), 6: ("float32", 4), 7: ("bool", 1), 10: ("uint64", 8), 11: ("int64", 8),
            12: ("float64", 8)}
_STRING, _ARRAY = 8, 9
_FORMATS = {1: "<B", 2: "<H", 4: "<I", 8: "<Q"}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute, in the file
    num_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    alignment: int
    data_start: int
    tensors: tuple[TensorInfo, ...]
    strings: dict[str, str]  # the metadata's single strings (general.architecture, ...), as UTF-8


def _type_sizes() -> dict[int, tuple[str, int, int]]:
    """ggml type id -> (name, elements per block, bytes per block), from the ``gguf`` package's table."""
    from gguf import GGML_QUANT_SIZES

    return {int(t): (t.name, block, size) for t, (block, size) in GGML_QUANT_SIZES.items()}


class _Walk:
    def __init__(self, data: mmap.mmap, path: Path):
        self.data, self.path, self.pos, self.size = data, path, 0, len(data)

    def refuse(self, what: str) -> ConfigError:
        return ConfigError(f"GGUF file {self.path} cannot be read: it is truncated, damaged or not a GGUF "
                           f"file: {what} (header byte {self.pos} of {self.size})", param="model")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.refuse(f"{what} needs {n} bytes, past the end of the file")

    def uint(self, n: int, what: str) -> int:
        self.need(n, what)
        (value,) = struct.unpack_from(_FORMATS[n], self.data, self.pos)
        self.pos += n
        return int(value)

    def text(self, what: str) -> str:
        raw = self.string(what, MAX_TEXT_BYTES)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.refuse(f"{what} is not UTF-8 text") from None

    def string(self, what: str, limit: int | None = None) -> bytes:
        n = self.uint(8, f"the length of {what}")
        if limit is not None and n > limit:
            raise self.refuse(f"{what} says it is {n} bytes long (at most {limit})")
        self.need(n, what)
        self.pos += n
        return bytes(self.data[self.pos - n:self.pos]) if limit is not None else b""

    def value(self, vtype: int, what: str, depth: int = 0) -> int | None:
        """Skip one value; an integer scalar's value is returned (alignment needs it)."""
        if vtype in _SCALARS:  # each is 1, 2, 4 or 8 bytes: read as an unsigned integer (floats skipped so)
            return self.uint(_SCALARS[vtype][1], what)
        if vtype == _STRING:
            self.string(what)
            return None
        if vtype != _ARRAY or depth > 0:  # llama.cpp's writer never nests arrays
            raise self.refuse(f"{what} has value type {vtype}, which GGUF does not define here")
        etype = self.uint(4, f"the item type of {what}")
        count = self.uint(8, f"the length of {what}")
        if etype in _SCALARS:
            self.need(count * _SCALARS[etype][1], f"{what}'s {count} items")
            self.pos += count * _SCALARS[etype][1]
        elif etype == _STRING:
            if count * 8 > self.size - self.pos:  # each string at least its length field
                raise self.refuse(f"{what} says it holds {count} strings, more than the file has room for")
            data, pos, end = self.data, self.pos, self.size
            for _ in range(count):  # the one loop as long as the vocabulary: kept tight
                if pos + 8 > end:
                    break
                pos += 8 + int.from_bytes(data[pos:pos + 8], "little")
            else:
                if pos <= end:
                    self.pos = pos
                    return None
            raise self.refuse(f"{what}'s {count} strings run past the end of the file")
        else:
            raise self.refuse(f"{what} has items of type {etype}, which GGUF does not define")
        return None


def scan_gguf_header(path: str | Path) -> GGUFHeader:
    """Check every count, length, type, shape and offset of the GGUF header of ``path`` against the file;
    the tensor table, or a ``ConfigError`` naming the first lie."""
    path = Path(path)
    with open(path, "rb") as f:
        if f.seek(0, 2) < 24:
            raise ConfigError(f"GGUF file {path} cannot be read: it is truncated, damaged or not a GGUF file "
                              f"(only {f.tell()} bytes)", param="model")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _scan(_Walk(data, path))


def _scan(w: _Walk) -> GGUFHeader:
    if bytes(w.data[:4]) != b"GGUF":
        raise w.refuse("it does not start with 'GGUF'")
    w.pos = 4
    version = w.uint(4, "the version")
    if version not in (2, 3):
        raise w.refuse(f"version {version} (forwardpass reads GGUF versions 2 and 3)")
    n_tensors, n_kv = w.uint(8, "the tensor count"), w.uint(8, "the metadata count")
    if n_tensors * 29 > w.size or n_kv * 13 > w.size:  # the smallest tensor info / key-value pair
        raise w.refuse(f"{n_tensors} tensors and {n_kv} metadata entries cannot fit in the file")
    alignment = 32
    strings: dict[str, str] = {}
    for i in range(n_kv):
        key = w.string(f"metadata key {i}", MAX_NAME_BYTES).decode("utf-8", "replace")
        vtype = w.uint(4, f"the type of {key!r}")
        if vtype == _STRING:
            strings[key] = w.text(repr(key))
            continue
        value = w.value(vtype, repr(key))
        if key == "general.alignment":
            if vtype != 4 or value is None or value <= 0 or value & (value - 1) or value > MAX_ALIGNMENT:
                raise w.refuse(f"general.alignment is {value} (type {vtype}): a power of two (uint32) is "
                               "needed")
            alignment = value
    sizes = _type_sizes()
    infos = []
    for i in range(n_tensors):
        name = w.string(f"tensor {i}'s name", MAX_NAME_BYTES).decode("utf-8", "replace")
        n_dims = w.uint(4, f"{name}'s dimension count")
        if not 1 <= n_dims <= MAX_DIMS:
            raise w.refuse(f"tensor {name} has {n_dims} dimensions (1..{MAX_DIMS})")
        shape = tuple(w.uint(8, f"{name}'s shape") for _ in range(n_dims))
        ggml_type = w.uint(4, f"{name}'s type")
        if ggml_type not in sizes:
            raise w.refuse(f"tensor {name} has type id {ggml_type}, which ggml does not define")
        type_name, block, block_bytes = sizes[ggml_type]
        if any(d < 1 for d in shape) or shape[0] % block:
            raise w.refuse(f"tensor {name} has shape {list(shape)}: {type_name} needs dimensions >= 1 and "
                           f"rows of a multiple of {block}")
        elements = 1
        for d in shape:
            elements *= d
        infos.append((name, shape, ggml_type, w.uint(8, f"{name}'s offset"), elements // block * block_bytes))
    data_start = -(-w.pos // alignment) * alignment
    tensors, names, end = [], set(), data_start
    for name, shape, ggml_type, offset, nbytes in sorted(infos, key=lambda t: t[3]):
        if name in names:
            raise w.refuse(f"tensor {name} appears twice")
        names.add(name)
        start = data_start + offset
        if offset % alignment or start < end or start + nbytes > w.size:
            raise w.refuse(f"tensor {name}'s {nbytes} bytes at data offset {offset} are misaligned, overlap "
                           f"another tensor or end past the file ({w.size} bytes): it is truncated or "
                           "damaged")
        end = start + nbytes
        tensors.append(TensorInfo(name, shape, ggml_type, start, nbytes))
    return GGUFHeader(version, alignment, data_start, tuple(tensors), strings)
