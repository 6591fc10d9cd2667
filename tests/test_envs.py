"""``forwardpass/envs.py``: every ``FORWARDPASS_*`` variable is registered with a type, default and doc, read
at call time, and read nowhere else."""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path

import pytest

import forwardpass
from forwardpass import envs

PACKAGE = Path(forwardpass.__file__).parent


def _is_environ(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
            and node.value.id == "os") or (isinstance(node, ast.Name) and node.id == "environ")  # fmt: skip


def _is_getenv(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "getenv" and isinstance(node.value, ast.Name)
            and node.value.id == "os") or (isinstance(node, ast.Name) and node.id == "getenv")  # fmt: skip


def env_reads(tree: ast.Module) -> list[str]:
    """The variable names a module reads from the environment (``os.environ.get(N)``, ``os.getenv(N)``,
    ``os.environ[N]``, ``N in os.environ``), where ``N`` is a string or a module-level
    constant holding one."""
    consts = {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
              and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
              for target in node.targets if isinstance(target, ast.Name)}  # fmt: skip

    def name(arg: ast.expr) -> str | None:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
        if isinstance(arg, ast.Name):
            return consts.get(arg.id)
        if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
            return str(arg.values[0].value)  # f"FORWARDPASS_{...}": its fixed start
        return None

    reads = []
    for node in ast.walk(tree):
        arg = None
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if _is_getenv(f) or (isinstance(f, ast.Attribute) and f.attr == "get" and _is_environ(f.value)):
                arg = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            arg = node.slice
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            arg = node.left
        if arg is not None and (n := name(arg)) is not None:
            reads.append(n)
    return reads


def test_the_detector_finds_every_kind_of_read():
    tree = ast.parse(
        "import os\nfrom os import environ\nVAR = 'FORWARDPASS_A'\n"
        "os.environ.get(VAR)\nos.getenv('FORWARDPASS_B', '1')\nos.environ['FORWARDPASS_C']\n"
        "'FORWARDPASS_D' in os.environ\nenviron.get(f'FORWARDPASS_E{1}')\nos.environ.get('HOME')\n"
        "os.environ['FORWARDPASS_F'] = '1'\n"  # a write, not a read
    )
    assert env_reads(tree) == ["FORWARDPASS_A", "FORWARDPASS_B", "FORWARDPASS_C", "FORWARDPASS_D",
                               "FORWARDPASS_E",
                               "HOME"]  # fmt: skip


def test_only_envs_reads_forwardpass_variables():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "envs.py":
            continue
        reads = [n for n in env_reads(ast.parse(path.read_text(), str(path))) if n.startswith("FORWARDPASS_")]
        offenders += [f"{rel}: {n}" for n in reads]
    assert offenders == [], "read these through forwardpass.envs.get (and register them there)"


def test_every_variable_the_package_names_is_registered():
    """Code, docstrings and comments alike: a knob documented somewhere is one envs.py knows."""
    named = {}
    for path in PACKAGE.rglob("*.py"):
        for n in re.findall(r"FORWARDPASS_[A-Z0-9_]*[A-Z0-9]", path.read_text()):
            named.setdefault(n, path.relative_to(PACKAGE).as_posix())
    unknown = {n: where for n, where in named.items() if n not in envs.VARS}
    assert unknown == {}
    assert all(v.doc and v.type in (bool, str) for v in envs.VARS.values())


def test_values_are_read_at_call_time_and_typed(monkeypatch, caplog):
    monkeypatch.delenv("FORWARDPASS_QUANT_KERNEL", raising=False)
    assert envs.get("FORWARDPASS_QUANT_KERNEL") is True  # the default
    for off in ("0", "false", "OFF", "no"):
        monkeypatch.setenv("FORWARDPASS_QUANT_KERNEL", off)
        assert envs.get("FORWARDPASS_QUANT_KERNEL") is False
    monkeypatch.setenv("FORWARDPASS_QUANT_KERNEL", "1")
    assert envs.get("FORWARDPASS_QUANT_KERNEL") is True
    monkeypatch.setenv("FORWARDPASS_QUANT_KERNEL", "")
    assert envs.get("FORWARDPASS_QUANT_KERNEL") is True  # empty: unset

    monkeypatch.delenv("FORWARDPASS_QUANT_GEMM", raising=False)
    assert envs.get("FORWARDPASS_QUANT_GEMM") is None  # decided from the CPU
    monkeypatch.setenv("FORWARDPASS_QUANT_GEMM", "fp32")
    assert envs.get("FORWARDPASS_QUANT_GEMM") == "fp32"
    monkeypatch.setenv("FORWARDPASS_QUANT_GEMM", "fp64")  # not a choice: the default, said once
    monkeypatch.setattr(envs, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="forwardpass.envs"):
        assert envs.get("FORWARDPASS_QUANT_GEMM") is None and envs.get("FORWARDPASS_QUANT_GEMM") is None
    assert [r.getMessage() for r in caplog.records if "fp64" in r.getMessage()] == [
        "ignoring FORWARDPASS_QUANT_GEMM=fp64 (one of amx, vnni, avx2, bf16, fp32, or unset)"
    ]
    monkeypatch.setenv("FORWARDPASS_TP_WORKER_RUNNER", "tests.x:Y")  # a free-form string
    assert envs.get("FORWARDPASS_TP_WORKER_RUNNER") == "tests.x:Y"
    with pytest.raises(KeyError):
        envs.get("FORWARDPASS_NOT_A_KNOB")  # register it first


def test_describe_lists_what_is_set_and_hides_the_api_key(monkeypatch):
    monkeypatch.setenv("FORWARDPASS_QUANT_GEMM", "bf16")
    monkeypatch.setenv("FORWARDPASS_API_KEY", "sk-secret")
    monkeypatch.delenv("FORWARDPASS_PACKED_WEIGHTS", raising=False)
    monkeypatch.setenv("FORWARDPASS_HUGE_PAGES", "")
    described = envs.describe()
    assert described["FORWARDPASS_QUANT_GEMM"] == "bf16" and described["FORWARDPASS_API_KEY"] == "***"
    assert "FORWARDPASS_PACKED_WEIGHTS" not in described and "FORWARDPASS_HUGE_PAGES" not in described
    assert "sk-secret" not in repr(described)
