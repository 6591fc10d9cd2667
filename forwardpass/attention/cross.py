"""Cross-attention over a request's cached encoder K/V (encoder–decoder models: Whisper).

Each request's cross-attention keys and values were written once into its slot of the layer's cache
(``[num_slots, 2, encoder_len, heads, head_dim]``, ``engine/scheduling/cross_attention_spec.py``) when its
encoder ran. A step's queries read them through the slot each sequence holds, which the group's
``StateMetadata`` gives (``ctx.for_state``): each one-token row reads its slot in place (a batched
call would first gather every row's slot, a copy larger than the attention's own reads), then each
prefill chunk with its own slot. No mask: every decoder position sees every encoder position.
"""

from __future__ import annotations

import torch
from torch import nn

from forwardpass.attention import attention
from forwardpass.attention.context import AttentionContext
from forwardpass.attention.kv_cache_interface import AttentionShape, CrossAttentionSpec, KVCacheSpec


class CachedCrossAttention(nn.Module):
    def __init__(self, cache_id: int, scale: float, encoder_len: int):
        super().__init__()
        self.cache_id = cache_id  # index of this layer's cross-attention cache in ctx.kv_caches
        self.scale = scale
        self.encoder_len = encoder_len  # the encoder's output positions (Whisper: max_source_positions)

    def kv_cache_spec(self, spec: AttentionShape, block_size: int,
                      dtype: torch.dtype) -> dict[int, KVCacheSpec | None]:
        """One slot per request holding its cross K and V over the encoder's ``encoder_len`` outputs."""
        enc, heads, d = self.encoder_len, spec.heads, spec.head_dim
        return {self.cache_id: CrossAttentionSpec(block_size=block_size, state_size=2 * enc * heads * d,
                                                  dtype=dtype, encoder_len=enc, num_heads=heads, head_dim=d)}

    def forward(self, q: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """``q``: ``[T, H, D]`` queries of the flattened batch → ``[T, H, D]``."""
        cache = ctx.kv_caches[self.cache_id]
        meta = ctx.for_state(self.cache_id)
        out = torch.empty_like(q)
        nd = ctx.num_decode
        for row, slot in enumerate(meta.decode_slots.tolist() if nd else ()):
            kv = cache[slot]  # a view: gathering the rows' slots would copy 2·S·H·D values per layer and step
            out[row] = self._attend(q[row, None, :, None, :], kv[0][None], kv[1][None], ctx.backend)[0, :, 0]
        for span in meta.prefills:
            rows = slice(span.q_start, span.q_start + span.q_len)
            kv = cache[span.slot]  # [2, S, H, D]
            attended = self._attend(q[rows].transpose(0, 1)[None], kv[0][None], kv[1][None], ctx.backend)
            out[rows] = attended[0].transpose(0, 1)
        return out

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str) -> torch.Tensor:
        """``q`` ``[B, H, Nq, D]``; ``k``, ``v`` ``[B, S, H, D]`` as cached → ``[B, H, Nq, D]``."""
        return attention(
            q, k.transpose(1, 2), v.transpose(1, 2), causal=False, scale=self.scale, backend=backend
        )
