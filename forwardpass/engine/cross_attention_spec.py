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
``layers + i`` (``cross_cache_id``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from forwardpass.engine.kv_cache_spec import FullAttentionSpec, KVCacheSpec, StateSpec
from forwardpass.loader.spec import ModelSpec


@dataclass(frozen=True)
class CrossAttentionSpec(StateSpec):
    """One request's cross-attention K and V: ``[2, encoder_len, num_heads, head_dim]`` per layer, in the
    model's dtype (they are projections, not accumulated states)."""

    encoder_len: int = 1
    num_heads: int = 1
    head_dim: int = 1

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, 2, self.encoder_len, self.num_heads, self.head_dim)


def cross_cache_id(model: ModelSpec, layer: int) -> int:
    return model.layers + layer


def encoder_decoder_specs(model: ModelSpec, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec | None]:
    """Self-attention pages for the decoder layers, then one cross-attention slot spec per layer."""
    assert model.whisper is not None
    enc_len = model.whisper.max_source_positions
    full = FullAttentionSpec(
        block_size=block_size, num_kv_heads=model.kv_heads, head_dim=model.head_dim, dtype=dtype
    )
    cross = CrossAttentionSpec(
        block_size=block_size,
        state_size=2 * enc_len * model.heads * model.head_dim,
        dtype=dtype,
        encoder_len=enc_len,
        num_heads=model.heads,
        head_dim=model.head_dim,
    )
    return [full] * model.layers + [cross] * model.layers
