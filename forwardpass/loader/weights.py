"""Checkpoint tensors by name, read lazily from memory-mapped safetensors files.

Only safetensors are read: pickle checkpoints (``*.bin``, ``*.pt``) can execute code when loaded, so
they are refused with the command that converts them. Every file's header is validated when the
source is opened, so a truncated download fails at load time with the file's name instead of as a
Rust panic halfway through building the model.
"""

from __future__ import annotations

import difflib
import json
import math
import struct
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from forwardpass.errors import (
    CorruptWeightsError,
    MissingFileError,
    MissingTensorError,
    ModelNotFoundError,
    UnsafeCheckpointError,
    WeightShapeError,
)
from forwardpass.loader.paths import check_inside, model_file

INDEX_FILE = "model.safetensors.index.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
# A real header is a few MB even for thousands of tensors; anything larger is garbage, not a header.
_MAX_HEADER_BYTES = 100 * 1024 * 1024

# safetensors dtype string -> (torch dtype, bytes per element). Sub-byte types are not listed: their
# size check is skipped rather than guessed.
_DTYPES: dict[str, tuple[torch.dtype | None, int]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "U16": (getattr(torch, "uint16", None), 2),
    "U32": (getattr(torch, "uint32", None), 4),
    "U64": (getattr(torch, "uint64", None), 8),
    "BOOL": (torch.bool, 1),
    "F8_E4M3": (getattr(torch, "float8_e4m3fn", None), 1),
    "F8_E5M2": (getattr(torch, "float8_e5m2", None), 1),
    "F8_E8M0": (getattr(torch, "float8_e8m0fnu", None), 1),
}

_CONVERT_HINT = (
    "pickle checkpoints are never unpickled (loading them can run arbitrary code); convert with "
    "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)"
)


def _model_dir(model_dir: str | Path) -> Path:
    path = Path(model_dir)
    if not path.exists():
        raise ModelNotFoundError(
            f"model path {str(path)!r} does not exist; pass a directory written by save_pretrained"
        )
    if not path.is_dir():
        raise ModelNotFoundError(f"model path {str(path)!r} is not a directory; pass the model's directory")
    return path


def find_weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files that hold the model's weights, in a stable order.

    With ``model.safetensors.index.json`` the index is the source of truth (it may sit beside other
    safetensors files, e.g. Mistral's ``consolidated.safetensors``); every shard it lists must exist.
    """
    path = _model_dir(model_dir)
    index_path = model_file(path, INDEX_FILE)
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
            weight_map = index["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptWeightsError(
                f"{index_path} is not a valid safetensors index (needs a JSON object with a 'weight_map' "
                f"of tensor name -> file): {exc}; re-save the model with save_pretrained"
            ) from exc
        files = [model_file(path, name) for name in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise MissingFileError(
                f"{index_path.name} in {path} lists shard(s) that are missing: {', '.join(missing)}; "
                "the download is incomplete — fetch the missing files or re-save the model"
            )
        return files

    files = sorted(check_inside(path, f) for f in path.glob("*.safetensors"))
    # Mistral repos ship both HF-named shards and a consolidated file with different tensor names.
    if len(files) > 1 and any(f.name != "consolidated.safetensors" for f in files):
        files = [f for f in files if f.name != "consolidated.safetensors"]
    if files:
        return files

    pickles = sorted(f.name for f in path.iterdir() if f.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise UnsafeCheckpointError(
            f"{path} has only pickle checkpoint(s) ({', '.join(pickles)}): {_CONVERT_HINT}"
        )
    raise MissingFileError(
        f"no weights in {path}: expected model.safetensors (or sharded model-*.safetensors with "
        f"{INDEX_FILE}); write them with model.save_pretrained(dir)"
    )


def _read_header(file: Path) -> dict[str, dict]:
    """Parse and check a safetensors header without reading tensor data.

    safetensors itself rejects most damage, but its messages do not name the file and some versions
    panic; checking here gives one clear error and lets ``shape()`` answer without touching data.
    """
    size = file.stat().st_size
    bad = f"{file} is not a valid safetensors file"
    fix = "re-download it or re-save the model with save_pretrained"
    if size < 8:
        raise CorruptWeightsError(f"{bad}: it is only {size} bytes (truncated); {fix}")
    with file.open("rb") as fh:
        (header_len,) = struct.unpack("<Q", fh.read(8))
        if header_len == 0 or header_len > min(size - 8, _MAX_HEADER_BYTES):
            raise CorruptWeightsError(
                f"{bad}: its header length field says {header_len} bytes but the file is {size} bytes "
                f"(truncated or not safetensors); {fix}"
            )
        raw = fh.read(header_len)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: [[[[...
        raise CorruptWeightsError(f"{bad}: its header is not valid JSON ({exc}); {fix}") from None
    if not isinstance(header, dict):
        raise CorruptWeightsError(f"{bad}: its header is not a JSON object; {fix}")
    header.pop("__metadata__", None)

    data_size = size - 8 - header_len
    end_max = 0
    spans = []
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            if not all(isinstance(d, int) and d >= 0 for d in shape) or not 0 <= begin <= end:
                raise ValueError("negative dimension or offsets out of order")
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptWeightsError(
                f"{bad}: the header entry for tensor {name!r} is malformed ({exc}); {fix}"
            ) from exc
        itemsize = _DTYPES.get(dtype, (None, 0))[1]
        if itemsize and end - begin != math.prod(shape) * itemsize:
            raise CorruptWeightsError(
                f"{bad}: tensor {name!r} ({dtype} {shape}) should take {math.prod(shape) * itemsize} bytes "
                f"but its offsets span {end - begin}; {fix}"
            )
        end_max = max(end_max, end)
        spans.append((begin, end, name))
    spans.sort()
    for (_, prev_end, prev), (begin, _, name) in zip(spans, spans[1:], strict=False):
        if begin < prev_end:  # two tensors sharing bytes: a lie in one of the offsets
            raise CorruptWeightsError(f"{bad}: tensors {prev!r} and {name!r} overlap in the file; {fix}")
    if end_max > data_size:
        raise CorruptWeightsError(
            f"{file} is truncated: its header describes {end_max} bytes of tensor data but only {data_size} "
            f"are present (an interrupted download?); {fix}"
        )
    return header


def _open(file: Path):
    """Open a memory-mapped handle, turning any safetensors failure (even a panic) into our error."""
    try:
        return safe_open(str(file), framework="pt")
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # pyo3 PanicException derives from BaseException
        raise CorruptWeightsError(
            f"{file} could not be opened by safetensors ({type(exc).__name__}: {exc}); "
            "re-download it or re-save the model with save_pretrained"
        ) from exc


class WeightSource:
    """Read-only view of a checkpoint's tensors by name.

    Tensors are read from memory-mapped files one at a time (never a whole state dict at once), so
    peak memory while loading is the model plus one tensor.
    """

    def __init__(self, model_dir: Path, files: list[Path]):
        self.model_dir = model_dir
        self.files = files
        self._headers: dict[str, dict] = {}  # tensor name -> header entry (dtype, shape, offsets)
        self._file_of: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        for file in files:
            header = _read_header(file)
            for name, info in header.items():
                if name in self._file_of:
                    raise CorruptWeightsError(
                        f"tensor {name!r} appears in both {self._file_of[name].name} and {file.name} in "
                        f"{model_dir}; the checkpoint is inconsistent — re-save it with save_pretrained"
                    )
                self._file_of[name] = file
                self._headers[name] = info
            self._handles[file] = _open(file)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> WeightSource:
        """Find, validate and memory-map every weight file of ``model_dir``."""
        files = find_weight_files(model_dir)
        return cls(Path(model_dir), files)

    def keys(self) -> list[str]:
        return list(self._file_of)

    def __contains__(self, name: object) -> bool:
        return name in self._file_of

    def __len__(self) -> int:
        return len(self._file_of)

    def _require(self, name: str) -> None:
        if name in self._file_of:
            return
        close = difflib.get_close_matches(name, self._file_of, n=3, cutoff=0.6)
        hint = f"closest names: {', '.join(close)}" if close else f"{len(self._file_of)} tensors present"
        raise MissingTensorError(
            f"tensor {name!r} is not in the checkpoint in {self.model_dir} ({hint}); the weights do not "
            "match config.json's architecture, or the model's weight-name mapping is wrong"
        )

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor (a fresh CPU tensor in the checkpoint's dtype)."""
        self._require(name)
        file = self._file_of[name]
        try:
            return self._handles[file].get_tensor(name)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:
            raise CorruptWeightsError(f"reading tensor {name!r} from {file} failed ({exc})") from exc

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape from the header, without reading its data."""
        self._require(name)
        return tuple(self._headers[name]["shape"])

    def dtype(self, name: str) -> torch.dtype | None:
        """The tensor's torch dtype from the header (None for a dtype this torch lacks)."""
        self._require(name)
        return _DTYPES.get(self._headers[name]["dtype"], (None, 0))[0]

    def close(self) -> None:
        """Drop the memory maps (tensors already returned stay valid: they are copies)."""
        self._handles.clear()


def load_into(
    param: torch.Tensor,
    source: WeightSource,
    name: str,
    *,
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Copy checkpoint tensor ``name`` (optionally transformed, e.g. a TP slice) into ``param``.

    The dtype is converted (bf16 checkpoint -> fp32 param is fine); the shape must match exactly,
    because a silent broadcast would hide a config/weights mismatch.
    """
    tensor = source.get(name)
    found = tuple(tensor.shape)
    if transform is not None:
        tensor = transform(tensor)
    expected = tuple(param.shape)
    if tuple(tensor.shape) != expected:
        got = f"{tuple(tensor.shape)} (after transform; {found} in the file)" if transform else str(found)
        raise WeightShapeError(
            f"tensor {name!r} in {source.model_dir}: expected shape {expected}, found {got}; "
            "does config.json match the weights?"
        )
    with torch.no_grad():
        param.copy_(tensor)


def checkpoint_names(model: torch.nn.Module, name: str) -> list[tuple[str, tuple[int, int] | None]]:
    """Checkpoint tensor names feeding the model's parameter ``name``: ``[(name, None)]``, or for a merged
    parameter (a module listed in ``model.packed_modules``, e.g. ``qkv_proj`` of
    ``q_proj``/``k_proj``/``v_proj``) one ``(name, (start, end))`` per checkpoint tensor, its rows in the
    merged parameter."""
    packed = getattr(model, "packed_modules", {})
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            module = model.get_submodule(".".join(parts[: i + 1]))
            out = []
            for sub in packed[part]:
                sub_name = ".".join(parts[:i] + [sub] + parts[i + 1 :])
                out.append((sub_name, module.offsets[sub]))
            return out
    return [(name, None)]
