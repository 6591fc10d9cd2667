"""The serving engine: request state, the paged KV cache, the scheduler, the model runner, the step
loop, and the front ends that turn its token deltas into outputs. ``docs/architecture.md`` follows one
request through these files."""
