"""Hugging Face ids (``Qwen/Qwen3-0.6B``): the local cache and downloads. Every other model name (embedded and
packaged models, directories, ``.gguf`` files) is resolved by ``forwardpass/registry.py``, which calls this.

An id is looked up in the local Hugging Face cache first (``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``: the layout ``huggingface_hub`` writes, ``models--ORG--NAME/snapshots/COMMIT``)
and downloaded into it when it is missing and the network allows (not with ``HF_HUB_OFFLINE=1``). Only the
files a model directory needs are fetched: config, tokenizer and generation files and safetensors
weights (never pickles). Anything that goes wrong is one ``ModelNotFoundError`` line saying what to do.

``cached_models()`` lists what the cache holds, for ``forwardpass models``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from forwardpass.errors import ModelNotFoundError

#: What a model directory needs; pickled weights (``*.bin``, ``*.pt``) are never downloaded or loaded.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt", "*.model"]
EMBEDDED_NAME = "forwardpass-default"
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")


def hub_cache_dir() -> Path:
    """The cache directory, read from the environment at call time (``huggingface_hub`` reads it once, at
    import, so a changed ``HF_HOME`` would otherwise be missed)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def looks_like_hub_id(name: str) -> bool:
    """``org/name`` or ``name`` that is not a path on this machine."""
    return bool(_ID.match(name)) and ".." not in name and not Path(name).expanduser().exists()


def is_cached(repo_id: str, revision: str | None = None) -> bool:
    """Whether the Hugging Face cache holds a snapshot of ``repo_id`` at ``revision`` (nothing is fetched)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot_download(repo_id, revision=revision, cache_dir=hub_cache_dir(), local_files_only=True,
                          allow_patterns=ALLOW_PATTERNS)
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        return False
    return True


def snapshot(repo_id: str, revision: str | None) -> Path:
    """The cached snapshot of ``repo_id`` at ``revision``, downloaded when missing (and allowed)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = hub_cache_dir()
    at = f" at revision {revision}" if revision else ""
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True,
                                      allow_patterns=ALLOW_PATTERNS))
    except (LocalEntryNotFoundError, FileNotFoundError):
        pass  # not cached: download it, if we may
    except ValueError as exc:  # a malformed id or revision
        raise ModelNotFoundError(f"{repo_id}{at}: {exc}", param="model") from None
    if offline():
        raise ModelNotFoundError(
            f"{repo_id}{at} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set; download "
            f"it where the network allows (hf download {repo_id}) or pass a model directory", param="model")
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                      allow_patterns=ALLOW_PATTERNS))
    except GatedRepoError:
        raise ModelNotFoundError(f"{repo_id} is gated on the Hugging Face Hub: accept its licence there and "
                                 "log in (hf auth login), then retry", param="model") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(f"{repo_id} is not a model on the Hugging Face Hub (nor a local directory)",
                                 param="model") from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"{repo_id} has no revision {revision!r}", param="revision") from None
    except Exception as exc:  # noqa: BLE001 - connection errors come in many classes; all mean "could not fetch"
        reason = (str(exc).splitlines() or [type(exc).__name__])[0].removeprefix("Got: ")
        raise ModelNotFoundError(
            f"{repo_id}{at} is not in the Hugging Face cache ({cache}) and could not be downloaded "
            f"({reason[:160]}); download it where the network allows "
            f"(hf download {repo_id}) or pass a model directory", param="model") from None


@dataclass(frozen=True)
class CachedModel:
    repo_id: str
    revisions: tuple[str, ...]  # refs (main, tags) or short commits
    size_bytes: int
    path: Path  # the newest snapshot
    architecture: str | None


def cached_models() -> list[CachedModel]:
    """Models in the local Hugging Face cache (repos with a ``config.json`` snapshot), by id."""
    import json

    cache = hub_cache_dir()
    out = []
    if not cache.is_dir():
        return out
    for repo in sorted(cache.glob("models--*")):
        snapshots = sorted((repo / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime, reverse=True)
        snapshots = [s for s in snapshots if (s / "config.json").is_file()]
        if not snapshots:
            continue
        repo_id = repo.name[len("models--"):].replace("--", "/")
        refs = repo / "refs"
        names = sorted(p.name for p in refs.rglob("*") if p.is_file()) if refs.is_dir() else []
        revisions = tuple(names) or tuple(s.name[:8] for s in snapshots)
        size = sum(f.resolve().stat().st_size for s in snapshots for f in s.rglob("*") if f.is_file())
        try:
            arch = (json.loads((snapshots[0] / "config.json").read_text()).get("architectures") or [None])[0]
        except (OSError, ValueError, AttributeError):
            arch = None
        out.append(CachedModel(repo_id, revisions, size, snapshots[0], arch))
    return out
