"""The ranks of one tensor-parallel engine: start the workers, join their group, notice their failures.

The engine process is rank 0 (the *driver*): it runs the scheduler, its own share of the model, and
the sampler. Ranks ``1..N-1`` (*workers*, ``worker.py``) hold the rest of the model and only compute.
Each step the driver broadcasts a :class:`StepMessage` — the step's ``SchedulerOutput`` and the tokens
it sampled in the previous step, from which the workers keep their mirror of the sequences — then
every rank runs the same forward pass, meeting in the all-reduces, and rank 0 samples
(``driver.DriverRunner``).

Two ways to get the workers:

* **spawned** (``LLM(model, tensor_parallel_size=N)``, ``forwardpass serve --tensor-parallel-size N``):
  the driver opens a ``TCPStore`` on a free local port and starts N-1 workers with
  ``torch.multiprocessing`` (spawn).
* **torchrun** (several machines): every process is started by ``torchrun``; rank 0's engine joins
  the group through the ``env://`` rendezvous, the other ranks run ``worker.run_worker`` directly.

Failures: a worker that raises writes its error into the store under ``error/<rank>`` and exits; one
that dies closes its sockets; one that hangs lets the collective time out (``distributed_timeout_s``).
In all three cases the step raises :class:`WorkerFailedError` (an ``EngineDeadError``: the requests
fail with it, the server's ``/health`` answers 503) naming the rank and its error, and the engine
stays dead: the ranks' states can no longer be trusted to agree.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from forwardpass.config import EngineConfig
from forwardpass.engine.scheduling.batch import SchedulerOutput
from forwardpass.errors import ConfigError, EngineDeadError
from forwardpass.parallel_state import TensorParallel, create_group

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0  # workers import torch and load their shard before this
PREFIX = "forwardpass"


class WorkerFailedError(EngineDeadError):
    """A tensor-parallel rank failed (raised, died or timed out); the engine cannot go on."""

    error_type = "worker_failed"


@dataclass(frozen=True)
class StepMessage:
    scheduled: SchedulerOutput
    sampled: tuple[tuple[int, int], ...]  # (seq id, token) the driver sampled in the previous step


@dataclass(frozen=True)
class WorkerLaunch:
    """What a spawned worker needs to join the group and build its part of the engine (picklable)."""

    model: str
    config: EngineConfig
    rank: int
    size: int
    host: str
    port: int
    num_threads: int


def torchrun_world() -> tuple[int, int] | None:
    """``(rank, world size)`` when this process was started by torchrun (its environment says so)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def rank_device(device: str, local_rank: int) -> str:
    """Each rank of a GPU group uses its own GPU (``cuda:<local rank>``); CPU ranks share ``cpu``."""
    return f"cuda:{local_rank}" if device == "cuda" else device


class ParallelGroup:
    """The driver's handle on the workers: the group, the store their errors arrive in, their processes."""

    def __init__(self, size: int, store: dist.Store, procs: list[Any]):
        self.size, self.store, self.procs = size, store, procs
        self.tp = TensorParallel()  # joined once every worker is up
        self.worker_weight_bytes: dict[int, int] = {}  # rank -> bytes of its parameters (as it reported them)
        self.failure: WorkerFailedError | None = None
        self._closed = False

    @classmethod
    def start(cls, model: str, config: EngineConfig) -> ParallelGroup:
        n = config.tensor_parallel_size
        world = torchrun_world()
        procs: list[Any] = []
        if world is not None:
            if world != (0, n):
                raise ConfigError(
                    f"under torchrun the engine runs on rank 0 of tensor_parallel_size={n} ranks; "
                    f"this is rank {world[0]} of {world[1]}",
                    param="tensor_parallel_size",
                )
            store, _, _ = next(dist.rendezvous("env://", 0, n, timeout=timedelta(seconds=STARTUP_TIMEOUT_S)))
            store = dist.PrefixStore(PREFIX, store)
        else:
            store = dist.TCPStore(
                "127.0.0.1", 0, n, True, timeout=timedelta(seconds=STARTUP_TIMEOUT_S), wait_for_workers=False
            )
            procs = _spawn(model, config, store.port, n)
        group = cls(n, store, procs)
        try:
            group._wait_for_workers(n)
            group.tp = create_group(
                store,
                "tp",
                0,
                n,
                device=rank_device(config.device, 0),  # rank 0 is local rank 0 (spawned, or under torchrun)
                timeout_s=config.distributed_timeout_s,
                expert_parallel=config.enable_expert_parallel,
            )
        except BaseException:
            group.close()
            raise
        weakref.finalize(group, _stop, procs, 0.0)  # an engine dropped without close(): stop its workers
        return group

    def _wait_for_workers(self, n: int, stage: str = "up") -> None:
        """Until every worker reached ``stage``; one that fails or exits first fails the
        start with its error."""
        keys = [f"{stage}/{r}" for r in range(1, n)]
        errors = [f"error/{r}" for r in range(1, n)]
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.store.check(keys):
            failed = any(p.exitcode is not None for p in self.procs) or any(
                self.store.check([e]) for e in errors
            )
            if failed or time.monotonic() > deadline:
                raise self.diagnose(
                    TimeoutError(f"the workers did not reach '{stage}' in {STARTUP_TIMEOUT_S:.0f} s")
                )
            time.sleep(0.05)

    def share_setup(self, setup: Any) -> None:
        """Once every worker has loaded its shard: send them what the driver decided (KV layout, kernel)."""
        self._wait_for_workers(self.size, "loaded")
        self.worker_weight_bytes = {r: int(self.store.get(f"loaded/{r}")) for r in range(1, self.size)}
        logger.info(
            "tensor parallel: %d ranks; weight bytes of the workers: %s", self.size, self.worker_weight_bytes
        )
        self.tp.broadcast_object(setup)
        # a worker's runner setup (KV cache, loading the decode kernel) can take longer than one step's
        # timeout: the first step is sent once every worker waits for it
        self._wait_for_workers(self.size, "ready")

    # ----- failures --------------------------------------------------------------------------------
    def diagnose(self, exc: BaseException) -> WorkerFailedError:
        """The clearest account of a failed collective: the workers' own errors, their exit codes."""
        reasons = []
        for rank in range(1, self.size):
            try:
                if self.store.check([f"error/{rank}"]):
                    reasons.append(f"rank {rank} raised {self.store.get(f'error/{rank}').decode()}")
                    continue
            except Exception as err:  # noqa: BLE001 - the store lives in this process or on rank 0's agent
                logger.debug("could not read rank %d's error from the store: %s", rank, err)
            proc = self.procs[rank - 1] if rank - 1 < len(self.procs) else None
            if proc is not None and proc.exitcode is not None:
                reasons.append(f"rank {rank} exited with code {proc.exitcode}")
        detail = "; ".join(reasons) or f"{type(exc).__name__}: {exc}"
        return WorkerFailedError(f"a tensor-parallel worker failed: {detail}")

    def fail(self, exc: BaseException) -> WorkerFailedError:
        if self.failure is None:
            time.sleep(0.2)  # a worker that raised writes its error before its sockets close; let it land
            self.failure = self.diagnose(exc)
            logger.error("%s; the engine stops", self.failure)
            self.close()
        return self.failure

    def close(self) -> None:
        """Tell the workers to stop (best effort), then make sure they are gone."""
        if self._closed:
            return
        self._closed = True
        if self.failure is None and self.tp.enabled:
            try:
                self.tp.broadcast_object(None)
            except Exception as err:  # noqa: BLE001 - a worker already gone
                logger.debug("could not tell the workers to stop: %s", err)
        _stop(self.procs)


def _stop(procs: list[Any], grace_s: float = 2.0) -> None:
    for p in procs:
        p.join(grace_s)
        if p.is_alive():
            p.kill()
            p.join(2)


def _spawn(model: str, config: EngineConfig, port: int, n: int) -> list[Any]:
    from forwardpass.distributed.worker import spawned_worker_main

    ctx = multiprocessing.get_context("spawn")
    # The server's engine process is daemonic (it must die with the server), and multiprocessing refuses
    # children of daemonic processes only because it would not clean them up; here the driver does
    # (``_stop``, and workers exit when the driver's sockets close), so lift the flag while starting them.
    current = multiprocessing.current_process()
    daemonic = current._config.get("daemon")
    current._config["daemon"] = False
    try:
        procs = []
        for rank in range(1, n):
            launch = WorkerLaunch(model, config, rank, n, "127.0.0.1", port, torch.get_num_threads())
            p = ctx.Process(
                target=spawned_worker_main, args=(launch,), name=f"forwardpass-tp{rank}", daemon=True
            )
            p.start()
            procs.append(p)
        return procs
    finally:
        current._config["daemon"] = daemonic
