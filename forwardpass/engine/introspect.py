"""Read-only views of the engine's state for the live dashboard, taken between two steps.

``block_map(core)`` is what the engine loop answers a ``BlockMapRequest`` with: the state of every KV
block of the first layer group's pool, one small int each (so a pool of 10k blocks is a 10k-int list):
``0`` free, ``1`` free but still holding a prefix-cached block, ``2 + i`` owned by ``requests[i]``
(the first owner when a cached prefix is shared; ``shared`` counts those blocks); ``waiting`` lists the
waiting requests in queue order. It changes nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from forwardpass.engine.core import EngineCore

FREE, CACHED, OWNED = 0, 1, 2


def block_map(core: EngineCore) -> dict[str, Any]:
    kv = core.kv
    pool = kv.pools[0]
    states = [CACHED if b.hash is not None else FREE for b in pool.blocks]
    requests: list[str] = []
    index: dict[str, int] = {}
    for seq in core.scheduler.running:
        i = index.setdefault(seq.request_id, len(requests))
        if i == len(requests):
            requests.append(seq.request_id)
        for b in kv.block_tables(seq)[0]:
            if b >= 0 and states[b] < OWNED:  # negative: a sliding-window slot already freed
                states[b] = OWNED + i
    shared = sum(1 for b in pool.blocks if b.ref_count > 1)
    waiting = list(dict.fromkeys(seq.request_id for seq in core.scheduler.waiting))
    return {"num_blocks": pool.num_blocks, "block_size": kv.block_size, "states": states,
            "requests": requests, "waiting": waiting, "shared": shared}
