"""Where the engine loop runs: a thread of this process, or a process of its own.

Both transports take ``post(events)``, called from a non-event-loop thread with each list of events
the loop emits, and offer ``send(command)`` and ``join(timeout)``.

**Process** (the server's default). On the CPUs we serve from, a CPU-busy Python thread next to the
model step slowed its matmuls 3–6× in our measurements: every torch op releases the GIL and must win it
back from the thread that is busy encoding JSON. Under load the HTTP side *is* busy, so a thread would
tax every forward pass exactly when throughput matters. The process boundary costs one pickle of each
step's token deltas. Spawned, not forked: fork would copy the server's threads and torch state.

**Thread** starts faster (no second ``import torch``), so the unit tests and embedded uses take it.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from forwardpass.engine.frontend.core_loop import EngineLoop, EngineSpec
from forwardpass.engine.frontend.protocol import EngineCommand, EngineDead, EngineEvent

logger = logging.getLogger(__name__)

Post = Callable[[list[EngineEvent]], None]


class ThreadTransport:
    def __init__(self, spec: EngineSpec, post: Post):
        self._inbox: queue.Queue[EngineCommand] = queue.Queue()
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._main, args=(spec, post), name="forwardpass-engine", daemon=True
        )
        self._thread.start()

    def _main(self, spec: EngineSpec, post: Post) -> None:
        try:
            EngineLoop(spec, self._inbox, post, lambda: True).run()
        finally:
            self._stopped.set()

    def send(self, command: EngineCommand) -> None:
        self._inbox.put(command)

    def join(self, timeout: float) -> None:
        self._stopped.wait(timeout)


def _process_main(spec: EngineSpec, inbox: Any, conn: Connection) -> None:
    """Entry point of the engine process."""
    # Ctrl-C reaches the whole process group, and so does a stop signal sent to it (systemd's default
    # KillMode, a benchmark's killpg): the server decides. It drains its requests and then stops this engine
    # (ProcessTransport.join, SIGKILL as the last resort); an engine that went down with the signal would fail
    # the requests being drained and look like a crash to the restart policy. The loop also ends when its
    # parent is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level, format="%(levelname)s %(name)s [engine]: %(message)s")
    parent = multiprocessing.parent_process()
    try:
        EngineLoop(spec, inbox, conn.send, lambda: parent is None or parent.is_alive()).run()
    except (BrokenPipeError, EOFError, OSError):
        pass  # the server went away
    finally:
        conn.close()


def exit_cause(exitcode: int | None, pid: int | None) -> str:
    """Why the engine process ended, in words: the signal that killed it, or its exit code."""
    if exitcode is None:
        return f"the engine process (pid {pid}) stopped answering"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = " (the out-of-memory killer sends SIGKILL: check the kernel log)" if name == "SIGKILL" else ""
        return f"the engine process (pid {pid}) was killed by {name}{hint}"
    return f"the engine process (pid {pid}) exited with exit code {exitcode}"


class ProcessTransport:
    def __init__(self, spec: EngineSpec, post: Post):
        ctx = multiprocessing.get_context("spawn")
        self._inbox = ctx.Queue()
        recv_conn, send_conn = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=_process_main, args=(spec, self._inbox, send_conn), name="forwardpass-engine", daemon=True
        )
        self._proc.start()
        send_conn.close()
        self._stopped = threading.Event()
        self._reader = threading.Thread(
            target=self._read, args=(recv_conn, post), name="forwardpass-reader", daemon=True
        )
        self._reader.start()

    def _read(self, conn: Connection, post: Post) -> None:
        try:
            while True:
                post(conn.recv())
        except (EOFError, OSError):
            pass
        except RuntimeError:  # the event loop is closed: nobody is left to tell
            return
        self._stopped.set()
        self._proc.join(5)
        post([EngineDead(exit_cause(self._proc.exitcode, self._proc.pid))])

    def send(self, command: EngineCommand) -> None:
        self._inbox.put(command)

    def join(self, timeout: float) -> None:
        self._stopped.wait(timeout)
        self._proc.join(timeout=5)
        if self._proc.is_alive():
            logger.warning("engine process did not stop; killing it")
            self._proc.kill()
            self._proc.join(5)
        if self._proc.exitcode != 0:  # nobody reads the queue any more: do not wait to flush it
            self._inbox.cancel_join_thread()
        self._inbox.close()
        self._inbox.join_thread()


TRANSPORTS: dict[str, type[ThreadTransport | ProcessTransport]] = {
    "thread": ThreadTransport,
    "process": ProcessTransport,
}
