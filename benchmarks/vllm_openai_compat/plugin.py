"""pytest plugin of the harness: sorts vLLM's tests into server tests (they start a RemoteOpenAIServer:
these are the cases counted) and unit tests of vLLM's own classes (left out), leaves out the server tests
``plan.EXCLUDED`` names with its reason, and writes every outcome to ``$FORWARDPASS_COMPAT_RESULT``."""

from __future__ import annotations

import inspect
import json
import os
import re
from typing import Any

import pytest

from benchmarks.vllm_openai_compat.plan import EXCLUDED

_UNIT = "unit test of vLLM's own classes (no server started)"
_records: dict[str, dict[str, Any]] = {}
_collect_errors: dict[str, str] = {}


def _source(obj: Any) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _starts_a_server(item: pytest.Function) -> bool:
    """The test, a fixture it uses, or a helper of its module that either calls, builds a server."""
    module_src = _source(item.module) if item.module else ""
    helpers = {name for name in re.findall(r"^(?:async )?def (\w+)", module_src, re.M)
               if "RemoteOpenAIServer" in _source(getattr(item.module, name, None))}
    sources = [_source(item.function)]
    for defs in item._fixtureinfo.name2fixturedefs.values():
        sources += [_source(d.func) for d in defs]
    return any("RemoteOpenAIServer" in s or any(f"{h}(" in s for h in helpers) for s in sources)


def _excluded(nodeid: str) -> str | None:
    for pattern, reason in EXCLUDED:
        if re.search(pattern, nodeid):
            return reason
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep, drop = [], []
    for item in items:
        reason = _UNIT if not (isinstance(item, pytest.Function) and _starts_a_server(item)) \
            else _excluded(item.nodeid)
        if reason is None:
            keep.append(item)
            _records[item.nodeid] = {"status": "collected"}
        else:
            drop.append(item)
            _records[item.nodeid] = {"status": "excluded", "reason": reason}
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        text = str(report.longrepr)
        lines = [ln for ln in text.splitlines() if ln.startswith("E ")]
        _collect_errors[report.nodeid] = (lines[-1] if lines else text.splitlines()[-1])[:300]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    record = _records.setdefault(report.nodeid, {})
    if report.when == "call" or report.outcome != "passed":
        if record.get("status") in {"failed", "error"}:
            return  # a teardown error after a failure keeps the failure
        status = report.outcome if report.when == "call" else ("skipped" if report.skipped else "error")
        record["status"] = status
        if report.failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            record["message"] = (crash.message if crash else str(report.longrepr))[:500]
        elif report.skipped and isinstance(report.longrepr, tuple):
            record["message"] = str(report.longrepr[2])[:300]


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get("FORWARDPASS_COMPAT_RESULT")
    if path:
        with open(path, "w") as f:
            json.dump({"tests": _records, "collection_errors": _collect_errors}, f, indent=1)
