"""A tensor-parallel worker (ranks 1..N-1): load this rank's shard, then run each step the driver sends.

A worker never schedules, and its samples are placeholders. It keeps the same mirror of the sequences
as the driver's runner (the ``ModelRunner`` state: tokens, block tables), builds the same flattened
batch from each ``SchedulerOutput`` with the same code and runs its share of the forward pass — its
attention heads, its MLP channels, its experts and vocabulary rows, its share of the KV cache —
meeting the other ranks in the all-reduces and in the gathers of the logits.

Errors: whatever a worker raises is written to the store under ``error/<rank>`` (the driver reads it
to fail the engine with that message), then the process exits, which closes its connections so the
other ranks' collectives fail at once instead of waiting for their timeout.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import signal
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from forwardpass import envs
from forwardpass.config import EngineConfig
from forwardpass.distributed.executor import PREFIX, STARTUP_TIMEOUT_S, StepMessage, WorkerLaunch, rank_device
from forwardpass.engine.scheduling.kv_cache_spec import KVCacheGroup
from forwardpass.engine.worker.model_runner import ModelRunner
from forwardpass.models.prepare import prepare_model, resolve_plan
from forwardpass.parallel_state import create_group

logger = logging.getLogger(__name__)
#: module:Class of a ``WorkerRunner`` subclass to run instead (the fault-injection tests set it)
RUNNER_ENV = "FORWARDPASS_TP_WORKER_RUNNER"


@dataclass(frozen=True)
class WorkerSetup:
    """What the driver decided while building the engine and every rank must share."""

    groups: list[KVCacheGroup]  # the KV cache layout: block ids mean the same on every rank
    decode_kernel: bool  # whether decode attention uses the compiled kernel (same numerics everywhere)


class WorkerRunner(ModelRunner):
    """Runs the driver's own ``ModelRunner.execute`` on this rank's shard, so the model is called the same
    way, in the same order (sampled rows, prompt logprobs, whatever the runner does next) and every
    collective meets its peers. Its logits are zeros (rank 0 holds the gathered ones), so what it
    samples is meaningless: the driver's tokens, sent with the next step, replace them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._appended: set[int] = set()  # sequences this rank appended a (placeholder) token to last step

    def step(self, msg: StepMessage) -> None:
        for seq_id, token in msg.sampled:
            if (seq := self.sequences.get(seq_id)) is None:
                continue
            if seq_id in self._appended:
                seq.output[-1] = token  # the driver's token in place of this rank's placeholder
            else:
                seq.output.append(token)
        self._appended = set(self.execute(msg.scheduled).seq_ids)


def _runner_class() -> type[WorkerRunner]:
    target = envs.get(RUNNER_ENV)
    if not target:
        return WorkerRunner
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def run_worker(
    model: str, config: EngineConfig, rank: int, size: int, store: dist.Store, local_rank: int
) -> None:
    """Join the group, load this rank's shard, run steps until the driver says stop (or fails)."""
    try:
        store.set(f"up/{rank}", "1")
        device = rank_device(config.device, local_rank)
        tp = create_group(
            store,
            "tp",
            rank,
            size,
            device=device,
            timeout_s=config.distributed_timeout_s,
            expert_parallel=config.enable_expert_parallel,
        )
        # the same plan as rank 0 (its decode-kernel decision arrives in
        # config.cpu_kernels) with this rank's group, the same preparation
        plan = dataclasses.replace(resolve_plan(config, model), tensor_parallel=tp)
        net, _ = prepare_model(model, plan)
        store.set(f"loaded/{rank}", str(sum(t.numel() * t.element_size() for t in net.parameters())))
        setup: WorkerSetup = tp.broadcast_object()
        kernel = plan.kernels.decode
        if setup.decode_kernel != (kernel is not None):
            raise RuntimeError(f"rank {rank} decided decode_kernel={kernel is not None}, the driver "
                               f"{setup.decode_kernel}")
        runner = _runner_class()(
            net,
            setup.groups,
            dtype=config.torch_dtype,
            device=device,
            attention_backend=config.attention_backend,
            decode_kernel=kernel,
        )
        store.set(f"ready/{rank}", "1")
        while (msg := tp.broadcast_object()) is not None:
            runner.step(msg)
    except BaseException as exc:  # noqa: BLE001 - reported to the driver, then this process ends
        logger.error("tensor-parallel rank %d failed: %s: %s", rank, type(exc).__name__, exc)
        try:
            store.set(f"error/{rank}", f"{type(exc).__name__}: {exc}")
        except Exception as err:  # noqa: BLE001 - the driver (and its store) may be gone already
            logger.debug("could not report the error to the driver: %s", err)
        os._exit(1)  # closes this rank's sockets now: the others' collectives fail instead of waiting
    os._exit(0)  # skip interpreter teardown of the process groups (nothing left to flush)


def spawned_worker_main(launch: WorkerLaunch) -> None:
    """Entry point of a worker the driver spawned (``torch.multiprocessing``, spawn)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the driver decides
    logging.basicConfig(
        level=logging.WARNING, format=f"%(levelname)s %(name)s [tp{launch.rank}]: %(message)s"
    )
    torch.set_num_threads(launch.num_threads)
    store = dist.TCPStore(
        launch.host, launch.port, launch.size, False, timeout=timedelta(seconds=STARTUP_TIMEOUT_S)
    )
    run_worker(launch.model, launch.config, launch.rank, launch.size, store, local_rank=launch.rank)


def torchrun_worker_main(model: str, config: EngineConfig) -> None:
    """Entry point of ranks > 0 under torchrun (``forwardpass serve`` on the other nodes)."""
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store, _, _ = next(dist.rendezvous("env://", rank, size, timeout=timedelta(seconds=STARTUP_TIMEOUT_S)))
    run_worker(
        model, config, rank, size, dist.PrefixStore(PREFIX, store), int(os.environ.get("LOCAL_RANK", "0"))
    )
