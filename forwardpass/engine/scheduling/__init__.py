"""The scheduling side: the scheduler (with its fairness rule), request state, the paged KV cache and its
block pool, per-layer cache specs, the interface speculative decoding plugs into (``speculation.py``), the
per-step cost model and step statistics. It imports nothing from ``worker/`` or ``speculative/``."""
