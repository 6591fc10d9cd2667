"""Cross-attention K/V as a per-request cache (encoder–decoder models: Whisper).

A decoder layer's cross-attention reads keys and values projected from the encoder's output. They
depend only on the request's encoder input, never on the decoder tokens, so they are computed once,
when the request's first chunk runs, and kept for the request's life instead of being recomputed
every step. Their size is fixed per request (``encoder_len`` positions: ``max_source_positions``,
since Whisper's input is always padded to its full length), which is exactly the state-slot
lifecycle of ``StateSpec``: one slot per running request, taken at admission by the first
``allocate_slots``, kept across prefill chunks and decode steps, returned at finish, abort or
preemption (a recomputed request runs its encoder again: its first chunk starts at position 0).
``plan_groups`` pays for ``max_num_seqs`` slots before dividing the rest among the paged groups, and
prefix caching is off (the decoder's prompt is the same for different audio).

Cache ids: decoder layer ``i``'s self-attention pages use id ``i``; its cross-attention slot id
``layers + i`` (``cross_cache_id``). The spec kind is ``CrossAttentionSpec``
(``attention/kv_cache_interface.py``), declared by each ``CachedCrossAttention`` (``attention/cross.py``).
"""

from __future__ import annotations

from forwardpass.attention.kv_cache_interface import CrossAttentionSpec
from forwardpass.models.model_spec import ModelSpec

__all__ = ["CrossAttentionSpec", "cross_cache_id"]


def cross_cache_id(model: ModelSpec, layer: int) -> int:
    return model.layers + layer
