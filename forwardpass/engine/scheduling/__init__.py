"""The scheduling core: EngineCore (one step), the scheduler, request state, the paged KV cache and its
block pool, per-layer cache specs, the builder that assembles a core around an
executor, and step statistics."""
