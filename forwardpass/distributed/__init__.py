"""Tensor, expert and data parallelism on ``torch.distributed`` (gloo on CPU, NCCL on GPU).

* ``parallel_state``: the process's tensor-parallel group (rank, size, collectives with timeouts).
* ``loading``: each rank reads only its shard of every weight from safetensors (``get_slice``).
* ``executor``: the driver (rank 0) spawns the workers (or joins torchrun's), detects their failures.
* ``driver``: rank 0's engine: what cannot be split is refused, each step is broadcast before it runs.
* ``worker``: a worker's loop: receive the step, run its share of the forward pass.
* ``moe``: the MoE block with its experts partitioned (expert parallel) or each expert split (tensor
  parallel).
* ``data_parallel``: N engine replicas behind one front end, requests to the least loaded.

See ``docs/distributed.md``.
"""
