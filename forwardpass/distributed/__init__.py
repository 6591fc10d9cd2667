"""Tensor, expert and data parallelism on ``torch.distributed`` (gloo on CPU, NCCL on GPU): the runtime, which
starts and drives the ranks and stands above the engine.

The model side sits below it, and nothing there imports this package: the group
(``forwardpass/parallel_state.py``, carried by the execution plan), the split layers
(``layers/parallel_linear.py``, ``layers/parallel_moe.py``) and each rank's shard of the checkpoint
(``models/parallel_loading.py``).

* ``executor``: the driver (rank 0) spawns the workers (or joins torchrun's), detects their failures.
* ``driver``: rank 0's engine: what cannot be split is refused, each step is broadcast before it runs.
* ``worker``: a worker's loop: receive the step, run its share of the forward pass.
* ``data_parallel``: N engine replicas behind one front end, requests to the least loaded.

See ``docs/distributed.md``.
"""
