"""Files of a model (or adapter) directory, resolved inside that directory.

A symlink in a downloaded model directory could point anywhere (``chat_template.jinja -> /etc/passwd``)
and the server would read it and let clients read it back through ``/tokenize`` + ``/detokenize``.
Every file forwardpass opens from a model directory goes through :func:`model_file`: it must resolve
inside the directory, or inside the same Hugging Face cache repository's ``blobs/`` (the hub cache
stores ``snapshots/<rev>/config.json`` as a symlink to ``../../blobs/<hash>``).
"""

from __future__ import annotations

from pathlib import Path

from forwardpass.errors import UnsafeModelFileError


def _allowed_roots(directory: Path) -> list[Path]:
    root = directory.resolve()
    roots = [root]
    if root.parent.name == "snapshots":  # a Hugging Face hub cache snapshot
        roots.append(root.parent.parent / "blobs")
    return roots


def model_file(directory: str | Path, name: str | Path) -> Path:
    """``directory / name``; raises ``UnsafeModelFileError`` if it resolves outside ``directory``."""
    path = Path(directory) / name
    if not path.exists() and not path.is_symlink():
        return path  # callers report missing files themselves
    check_inside(directory, path)
    return path


def check_inside(directory: str | Path, path: Path) -> Path:
    resolved = path.resolve()
    if any(resolved == r or resolved.is_relative_to(r) for r in _allowed_roots(Path(directory))):
        return path
    raise UnsafeModelFileError(
        f"{path} resolves to a file outside the model directory {directory}; refusing to read it "
        "(every file of a model directory, symlinks included, must stay inside it)"
    )
