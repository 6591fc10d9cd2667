"""Giving back what rejected drafts held, and refusing models whose cache cannot give it back.

A verify step computes K/V for ``1 + k`` positions; when only ``a`` drafts are accepted, the sequence's
computed length is set back to just after them (``Scheduler.update``) and the trailing blocks its new
length no longer needs are released. The K/V of rejected positions still in a kept block are never read:
attention reads positions below the query's, and the next step writes those slots again before any
query reaches them. Both sides cut their block tables with ``trim_table`` (``scheduling/kv_cache_spec.py``)
from the same numbers (the sequence's token count after the step), so the scheduler's tables and the runner's
mirror stay equal.

Paged K/V (full, sliding window, MLA latents) rolls back this way. A recurrent state (Mamba2, Gated
DeltaNet) has already folded the rejected tokens in, and DeepSeek-V4's compressor state too: those
models refuse ``speculative_config`` when the engine is built.
"""

from __future__ import annotations

from collections.abc import Sequence

from forwardpass.engine.scheduling.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheGroup,
    MLASpec,
    SlidingWindowSpec,
    StateSpec,
)
from forwardpass.errors import ConfigError

#: cache kinds whose entries are per position: cutting the computed length rolls them back
ROLLBACK_SAFE = (FullAttentionSpec, SlidingWindowSpec, MLASpec)


def check_can_roll_back(groups: Sequence[KVCacheGroup]) -> None:
    """Raise a ``ConfigError`` naming the cache that cannot be rolled back, if any."""
    for group in groups:
        spec = group.spec
        if type(spec) in ROLLBACK_SAFE:
            continue
        name = type(spec).__name__
        if isinstance(spec, StateSpec) and name == "StateSpec":
            why = "its recurrent state (Mamba2 / Gated DeltaNet layers) has already absorbed rejected tokens"
        elif isinstance(spec, StateSpec):
            why = f"its per-request {name} slot is not a per-position cache (encoder-decoder models)"
        else:
            why = f"its {name} cache (e.g. DeepSeek-V4's compressor state) cannot be rolled back"
        raise ConfigError(f"speculative decoding needs a cache that can be rolled back to an earlier length; "
                          f"this model cannot: {why}. Remove speculative_config", param="speculative_config")
