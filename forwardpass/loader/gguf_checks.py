"""What a GGUF file must pass before anything is built from it, each a clear error naming the problem: a file
the ``gguf`` reader cannot parse (truncated, not GGUF, an unknown type id), an architecture we do not run, a
tensor type we cannot compute with (refused from the tensor infos alone, before any kernel is compiled), a
tensor whose bytes in the file do not match its shape and type. All read the header only."""

from __future__ import annotations

from pathlib import Path

from forwardpass.errors import ConfigError, ModelNotFoundError
from forwardpass.quant.gguf_blocks import BLOCK_TYPES

ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
#: the tensor types we read: F32/F16/BF16 as fp32, Q8_0/Q4_0 into the Q8_0/Q4_0 kernels, the others into the
#: K-block kernel (quant/kblocks.py), each from its blocks as stored
SUPPORTED_TYPES = tuple(BLOCK_TYPES)


def open_reader(path: Path):
    """The ``gguf`` package's reader of ``path``, or a ConfigError saying why the file cannot be read."""
    try:
        from gguf import GGUFReader
    except ImportError:  # pragma: no cover - a dependency, but say what to do if it is missing
        raise ModelNotFoundError("reading a .gguf file needs the gguf package: pip install gguf") from None
    try:
        return GGUFReader(str(path))
    except (
        ValueError,
        IndexError,
        KeyError,
        OSError,
    ) as e:  # what its parser raises on a short or foreign file
        raise ConfigError(f"GGUF file {path} cannot be read: it is truncated, damaged or not a GGUF file "
                          f"({e})",
                          param="model") from None  # fmt: skip


def check_architecture(reader) -> str:
    arch = field(reader, "general.architecture")
    if arch not in ARCHS:
        raise ConfigError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHS)}", param="model"
        )
    return arch


def field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except (UnicodeDecodeError, ValueError, IndexError) as exc:  # a string that is not UTF-8, a bad value
        raise ConfigError(f"GGUF metadata {key} cannot be read ({type(exc).__name__}: {exc})",
                          param="model") from None


def check_tensor_types(reader) -> None:
    """Refuse a file with a tensor of a type we cannot read, from its tensor infos alone (no data is read):
    before a model is built or a kernel compiled for it, not when loading reaches that tensor, minutes
    later."""
    bad = [t for t in reader.tensors if t.tensor_type.name not in SUPPORTED_TYPES]
    if bad:
        types = sorted({t.tensor_type.name for t in bad})
        raise ConfigError(
            f"GGUF tensor {bad[0].name} has type {bad[0].tensor_type.name}; supported: "
            f"{', '.join(SUPPORTED_TYPES)} ({len(bad)} of the file's {len(reader.tensors)} tensors are "
            f"{' or '.join(types)})",
            param="model",
        )


def check_tensor_sizes(reader, path: Path) -> None:
    """Each tensor's bytes (its shape and type) must fill the space the file gives it: up to the next tensor's
    data (padded to the file's alignment), and the last one must end inside the file."""
    size = path.stat().st_size
    spans = sorted((t.data_offset, t) for t in reader.tensors)
    for i, (start, t) in enumerate(spans):
        block, nbytes = BLOCK_TYPES.get(t.tensor_type.name, (1, 0))
        need = int(t.n_elements) // block * nbytes if nbytes else int(t.n_bytes)
        shape = "x".join(str(int(d)) for d in t.shape)
        if i + 1 < len(spans):
            room = spans[i + 1][0] - start
            padded = -(-need // reader.alignment) * reader.alignment
            if room not in (need, padded):
                raise ConfigError(
                    f"GGUF tensor {t.name} ({t.tensor_type.name} [{shape}]) is {need} bytes, but the "
                    f"file holds {room} bytes for it: its shape or type is wrong",
                    param="model",
                )
        elif start + need > size:
            raise ConfigError(
                f"GGUF tensor {t.name} ({t.tensor_type.name} [{shape}]) ends at byte {start + need}, "
                f"past the end of the file ({size} bytes): the file is truncated",
                param="model",
            )


def check_file(path: Path):
    """The reader of a file that passes every check above (its architecture name returned with it). The
    header's numbers are checked against the file first (``gguf_header.py``), so the reader never follows
    a lie."""
    from forwardpass.loader.gguf_header import scan_gguf_header

    header = scan_gguf_header(path)  # (~0.2 s for a 49k vocabulary, where the reader takes seconds)
    arch = header.strings.get("general.architecture")
    if arch not in ARCHS:  # refused now, from the walk, not after the reader's
        raise ConfigError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHS)}", param="model"
        )
    from types import SimpleNamespace

    from gguf import GGMLQuantizationType

    check_tensor_types(SimpleNamespace(tensors=[  # the walk's tensor table, as the reader would give it
        SimpleNamespace(name=t.name, tensor_type=GGMLQuantizationType(t.ggml_type)) for t in header.tensors]))
    reader = open_reader(path)
    arch = check_architecture(reader)
    check_tensor_types(reader)
    check_tensor_sizes(reader, path)
    return reader, arch
