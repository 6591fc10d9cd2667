"""Layering rules of the code base (docs/architecture.md), checked so they stay true."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENGINE = REPO / "forwardpass" / "engine"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_engine_files_stay_small():
    sizes = {p.name: len(p.read_text().splitlines()) for p in ENGINE.glob("*.py")}
    assert max(sizes.values()) <= 250, {k: v for k, v in sizes.items() if v > 250}


def test_engine_never_imports_the_analyzer():
    for path in ENGINE.glob("*.py"):
        assert not any(m.startswith("forwardpass.analysis") for m in _imports(path)), path.name


def test_only_the_spec_reads_model_config_keys():
    """Models, engine, analyzer read ``ModelSpec``; config.json keys are resolved in loader/spec.py."""
    for sub in ("engine", "models", "analysis", "layers", "attention"):
        for path in (REPO / "forwardpass" / sub).glob("*.py"):
            text = path.read_text()
            for key in ('"num_hidden_layers"', '"num_key_value_heads"', '"sliding_window"', '"num_experts"'):
                assert key not in text or path.name == "presets.py", f"{path} reads {key}"


def test_the_repository_stands_alone():
    """No file points outside the repository (to notes that users do not have)."""
    outside = "../" + "shared"
    files = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    for name in files:
        path = REPO / name
        if (
            path.suffix in {".py", ".md", ".toml", ".txt", ".cfg", ".sh", ".json", ".html", ""}
            and path.is_file()
        ):
            assert outside not in path.read_text(errors="ignore"), name
