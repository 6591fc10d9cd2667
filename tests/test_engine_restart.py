"""An engine process that dies (SIGKILL: what the OS's out-of-memory killer sends) is noticed, reported and
replaced: its streams end with an error event naming the signal, requests meanwhile get 503 + Retry-After,
a fresh engine serves again, /metrics counts the restart; with ``--engine-restarts 0`` the server exits
non-zero instead. The real server (``forwardpass serve``) on the tiny random-weight model."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.helpers.server import SLOW_STEP_SEED, ServerProcess, make_served_model

pytestmark = pytest.mark.timeout(240)

KILL_TO_STREAM_ERRORS_S = 5.0  # the deadlines: generous on a busy machine, but asserted
KILL_TO_SERVED_AGAIN_S = 60.0
KILL_TO_EXIT_S = 10.0


@pytest.fixture(scope="module")
def model(checkpoint_factory, tmp_path_factory):
    return make_served_model(tmp_path_factory.mktemp("served"), checkpoint_factory("qwen3"))


def _server(model, restarts: int) -> ServerProcess:
    # each step of a SLOW_STEP_SEED request takes 0.3 s: the streams are still running at the kill
    return ServerProcess(model, "--engine-restarts", str(restarts), "--engine-factory",
                         "tests.helpers.server:FaultInjectingEngine")


class Stream(threading.Thread):
    """One long streaming completion; records its events and when the stream ended."""

    def __init__(self, url: str, started: threading.Semaphore):
        super().__init__(daemon=True)
        self.url, self.started = url, started
        self.events: list[dict] = []
        self.done_lines: list[str] = []
        self.ended_at: float | None = None

    def run(self) -> None:
        body = {"prompt": "hello", "max_tokens": 500, "stream": True, "ignore_eos": True,
                "seed": SLOW_STEP_SEED}
        first = True
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    self.done_lines.append(data)
                    continue
                self.events.append(json.loads(data))
                if first:
                    first = False
                    self.started.release()
        self.ended_at = time.monotonic()


def _start_streams(srv: ServerProcess, n: int = 4) -> list[Stream]:
    started = threading.Semaphore(0)
    streams = [Stream(srv.url, started) for _ in range(n)]
    for s in streams:
        s.start()
    for _ in streams:  # every stream has produced a token: all four are in the engine
        assert started.acquire(timeout=60), "a stream produced no token"
    return streams


def _kill_engine(srv: ServerProcess) -> float:
    pid = httpx.get(srv.url + "/debug/engine", timeout=30).json()["pid"]
    assert pid != srv.proc.pid
    os.kill(pid, signal.SIGKILL)
    return time.monotonic()


def test_sigkilled_engine_fails_its_streams_and_is_restarted(model):
    with _server(model, restarts=2) as srv:
        streams = _start_streams(srv)
        killed = _kill_engine(srv)
        for s in streams:
            s.join(KILL_TO_STREAM_ERRORS_S + 5)
        for s in streams:
            assert s.ended_at is not None and s.ended_at - killed < KILL_TO_STREAM_ERRORS_S, srv.log()
            assert any("choices" in e for e in s.events[:-1])  # it was streaming when the engine died
            error = s.events[-1]["error"]
            assert "SIGKILL" in error["message"] and error["type"] == "engine_dead", error
            assert s.done_lines == ["[DONE]"]
        # while it restarts: /health and new requests say so, with Retry-After
        health = httpx.get(srv.url + "/health", timeout=10)
        if health.status_code == 503:  # (a fast machine may already be back)
            assert "restarting" in health.json()["error"]["message"]
            assert int(health.headers["Retry-After"]) >= 1
        # served again within the deadline
        while True:
            r = httpx.post(srv.url + "/v1/completions", timeout=60,
                           json={"prompt": "again", "max_tokens": 4})
            if r.status_code == 200:
                break
            assert r.status_code == 503 and "Retry-After" in r.headers, r.text
            assert time.monotonic() - killed < KILL_TO_SERVED_AGAIN_S, srv.log()
            time.sleep(0.5)
        served_again = time.monotonic() - killed
        assert served_again < KILL_TO_SERVED_AGAIN_S
        print(f"kill -> every stream's error event: {max(s.ended_at for s in streams) - killed:.2f} s; "
              f"kill -> served again: {served_again:.1f} s")  # the figures (pytest -s)
        assert len(r.json()["choices"][0]["text"]) > 0
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
        assert 'forwardpass:engine_restarts_total{model_name="test-model"} 1.0' in metrics
        info = httpx.get(srv.url + "/debug/engine", timeout=30).json()
        assert info["invariants_ok"] and info["num_free_blocks"] == info["num_blocks"]
        log = srv.log_path.read_text(errors="replace")
    assert "ERROR" in log and "engine died: the engine process" in log and "killed by SIGKILL" in log
    assert "restarting it in" in log and "engine restarted (restart 1 of 2)" in log


def test_with_no_restarts_the_server_exits_non_zero(model):
    with _server(model, restarts=0) as srv:
        streams = _start_streams(srv)
        killed = _kill_engine(srv)
        try:
            code = srv.proc.wait(KILL_TO_EXIT_S + 20)
        finally:
            exited = time.monotonic()
        print(f"kill -> server exited: {exited - killed:.2f} s")  # the figure (pytest -s)
        assert exited - killed < KILL_TO_EXIT_S, srv.log()
        assert code not in (0, None), srv.log()
        for s in streams:
            s.join(5)
            assert s.events and "SIGKILL" in s.events[-1]["error"]["message"]
        log = srv.log_path.read_text(errors="replace")
    assert "restarts are off (--engine-restarts 0)" in log
    assert "error: the engine died and was not restarted" in log


def test_a_stop_signal_to_the_whole_group_drains_and_exits_cleanly(model):
    """SIGTERM sent to every process of the server (systemd's default ``KillMode=control-group``, a
    benchmark's ``killpg``), the engine first: the engine is not a casualty — the stream in flight is drained
    to its end, the server exits 0, and nothing says the engine died or is restarting."""
    with ServerProcess(model, "--engine-restarts", "2") as srv:
        body = {"prompt": "hello", "max_tokens": 200, "stream": True, "ignore_eos": True, "temperature": 0}
        events: list[str] = []
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    events.append(line)
                    break
            engine = httpx.get(srv.url + "/debug/engine", timeout=30).json()["pid"]
            os.kill(engine, signal.SIGTERM)
            srv.proc.send_signal(signal.SIGTERM)
            events += [line for line in lines if line.startswith("data: ")]
        assert srv.proc.wait(60) == 0, srv.log()
        log = srv.log_path.read_text(errors="replace")
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert "error" not in chunks[-1] and chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
    assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks) > 1
    assert "engine died" not in log and "restarting" not in log and "Traceback" not in log, log[-3000:]


def test_a_dead_engine_loop_is_restarted_in_process(model):
    """The same, inside ``AsyncLLMEngine`` (what every engine of a server gets): a fault that breaks the KV
    cache kills the loop; requests meanwhile get ``EngineRestartingError`` with a Retry-After; a fresh loop
    serves; with the restarts spent, ``on_engine_lost`` is called and the engine stays dead."""
    import asyncio

    from forwardpass import SamplingParams
    from forwardpass.engine.frontend.async_engine import AsyncLLMEngine, EngineSpec, RestartPolicy
    from forwardpass.errors import EngineDeadError, EngineRestartingError, ForwardpassError
    from tests.helpers.server import FATAL_FAULT_SEED, FaultInjectingEngine

    lost: list[str] = []
    fatal = SamplingParams(max_tokens=4, seed=FATAL_FAULT_SEED)
    ok = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

    async def run(rid, params):
        return [o async for o in engine.generate([5, 6, 7], params, rid)][-1]

    async def main():
        await engine.start()
        with pytest.raises(ForwardpassError, match="injected fatal fault"):
            await run("fatal-1", fatal)
        with pytest.raises(EngineRestartingError) as refused:
            await engine.add_request([5, 6], ok, "while-restarting")
        assert refused.value.retry_after_s >= 1 and refused.value.status_code == 503
        for _ in range(600):
            if not engine.is_dead:
                break
            await asyncio.sleep(0.1)
        assert len((await run("after", ok)).outputs[0].token_ids) == 3
        assert engine.num_restarts == 1 and not lost
        with pytest.raises(ForwardpassError, match="injected fatal fault"):
            await run("fatal-2", fatal)
        await asyncio.sleep(0.2)
        assert engine.is_dead and len(lost) == 1 and "KV cache is inconsistent" in lost[0]
        with pytest.raises(EngineDeadError) as dead:
            await engine.add_request([5, 6], ok, "after-the-last")
        assert not isinstance(dead.value, EngineRestartingError)
        await engine.shutdown(5)

    engine = AsyncLLMEngine(EngineSpec(str(model), {"num_kv_blocks": 64}, factory=FaultInjectingEngine),
                            backend="thread", restart_policy=RestartPolicy(max_restarts=1, backoff_s=0.2),
                            on_engine_lost=lost.append)
    asyncio.run(main())
