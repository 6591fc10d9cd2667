"""benchmarks/serve_peers.py's summary: a sweep measured in two runs joins into one table, and only when the
runs can be joined (same host, same servers, no point measured twice)."""

from __future__ import annotations

import copy

import pytest

from benchmarks.serve_peers import merged, summarize


def _point(tok_s: float, ttft_ms: float) -> dict:
    return {"output_throughput": tok_s, "median_ttft_ms": ttft_ms, "median_tpot_ms": 10.0,
            "mean_ttft_ms": ttft_ms, "p99_ttft_ms": ttft_ms, "duration": 10.0, "failed": 0, "completed": 8}


def _run(points: dict[str, dict[str, tuple[float, float]]]) -> dict:
    results = {s: {c: [_point(*v)] for c, v in per.items()} for s, per in points.items()}
    labels = {"fp-gguf": "forwardpass", "llama": "llama-server"}
    return {"host": "a 2-core test host", "args": {}, "labels": labels, "results": results}


def test_a_later_run_adds_its_concurrency_points():
    first = _run({"fp-gguf": {"1": (70, 300), "16": (200, 1300)},
                  "llama": {"1": (45, 900), "16": (70, 7900)}})
    later = _run({"fp-gguf": {"4": (116, 1040)}, "llama": {"4": (56, 3774)}})
    doc = merged(copy.deepcopy(first), [("c4.json", later)])
    assert sorted(doc["results"]["fp-gguf"], key=int) == ["1", "4", "16"]
    assert doc["merged_from"] == [{"file": "c4.json", "args": {}}]
    text = summarize(doc)
    assert "| c1 out tok/s | c1 TTFT | c1 TPOT | c4 out tok/s |" in text
    assert "forwardpass, c4: throughput 2.07x the best peer (2.07-2.07)" in text


@pytest.mark.parametrize("change", ["host", "labels", "clash"])
def test_runs_that_cannot_be_joined_are_refused(change):
    first = _run({"fp-gguf": {"1": (70, 300)}, "llama": {"1": (45, 900)}})
    later = _run({"fp-gguf": {"4": (116, 1040)}, "llama": {"4": (56, 3774)}})
    if change == "host":
        later["host"] = "another host"
    elif change == "labels":
        later["labels"] = {"fp-gguf": "forwardpass", "vllm-fp32": "vLLM"}
    else:
        later["results"]["llama"]["1"] = later["results"]["llama"].pop("4")
    with pytest.raises(SystemExit):
        merged(first, [("later.json", later)])
