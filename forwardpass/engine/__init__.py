"""The serving engine: request state, the paged KV cache, the scheduler, the model runner, the step
loop, and the front ends that turn its token deltas into outputs. ``docs/architecture.md`` follows one
request through these files.

Sub-packages in dependency order, each importing only those before it: ``scheduling/`` (request state, KV
manager, policy), ``worker/`` (the runner: one forward pass and its sampling), ``speculative/`` (drafts and
their verification, plugged into the two through the interfaces they declare), then the assembly at this
level (``core.py``, ``builder.py``, ``executor.py``, ``introspect.py``), then ``frontend/``."""
