"""The attention step of a decoder layer: store this step's K/V in the paged cache, then attend.

Models call ``CachedAttention(q, k, v, ctx)`` with the flattened batch (``[T, H, D]``); the context
says which rows belong to which sequence, and the layer reads the slot mapping and block tables of
its own KV cache group (``ctx.for_layer``). With ``ctx=None`` the whole input is one causal sequence
and nothing is cached (used for parity tests and scoring).

``softcap`` (Gemma 2) caps the attention logits; the compiled decode kernel has no cap, so such
layers always take the PyTorch path. The cache may be narrower than the model (``kv_cache_dtype``): K/V are
rounded when stored and widened when read.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from forwardpass.attention import attention
from forwardpass.attention.context import AttentionContext, GroupMetadata
from forwardpass.attention.kv_cache_interface import AttentionShape, KVCacheSpec, attention_spec
from forwardpass.attention.paged import paged_decode_attention, paged_prefill_attention, write_kv
from forwardpass.plan import current_plan

#: the caches the compiled K/V store and decode kernel read and write (attention/csrc/paged_decode.cpp)
KERNEL_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class CachedAttention(nn.Module):
    def __init__(
        self, layer_idx: int, scale: float, sliding_window: int | None = None, softcap: float | None = None
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap
        plan = current_plan()
        # the plan's compiled K/V store, for exactly this class (a subclass may change the math)
        self.fused: Any = plan.fused_ops if type(self) is CachedAttention else None
        # the batch-invariant plan: every query, prefill or decode, through the paged
        # kernel (None: per step kind)
        self.per_query_kernel: Any = plan.kernels.decode if plan.batch_invariant else None

    def kv_cache_spec(self, spec: AttentionShape, block_size: int,
                      dtype: torch.dtype) -> dict[int, KVCacheSpec | None]:
        """This layer's K/V pages (freed behind its window when it has one), for the model's KV heads."""
        return {self.layer_idx: attention_spec(block_size, spec.kv_heads, spec.head_dim, dtype,
                                               self.sliding_window)}

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext | None
    ) -> torch.Tensor:
        if ctx is None:
            out = attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                causal=True, scale=self.scale, sliding_window=self.sliding_window, softcap=self.softcap,
            )
            return out[0].transpose(0, 1)
        kv_cache = ctx.kv_caches[self.layer_idx]
        meta = ctx.for_layer(self.layer_idx)
        if (self.fused is not None and k.dtype == torch.float32 and kv_cache.dtype in KERNEL_CACHE_DTYPES
                and k.is_cpu):
            self.fused.write_kv_(kv_cache, k, v, meta.slot_mapping)
        else:
            write_kv(kv_cache, k, v, meta.slot_mapping)
        if self.per_query_kernel is not None:
            return self._attend_each_query(q, kv_cache, ctx, meta)
        nd = ctx.num_decode
        if nd and not meta.prefills:  # pure decode step: no copy of the output needed
            return self._decode(q, kv_cache, ctx, meta)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], kv_cache, ctx, meta)
        for span in meta.prefills:
            rows = slice(span.q_start, span.q_start + span.q_len)
            if span.context_len == span.q_len:
                # Nothing cached before this chunk: attend over the fresh K/V directly, no gather.
                out[rows] = attention(
                    q[rows].transpose(0, 1)[None], k[rows].transpose(0, 1)[None],
                    v[rows].transpose(0, 1)[None], causal=True, scale=self.scale,
                    sliding_window=self.sliding_window, softcap=self.softcap, backend=ctx.backend,
                )[0].transpose(0, 1)
            else:
                out[rows] = paged_prefill_attention(
                    q[rows], kv_cache, span.block_table, span.context_len,
                    scale=self.scale, sliding_window=self.sliding_window, softcap=self.softcap,
                    backend=ctx.backend,
                )
        return out

    def _attend_each_query(
        self, q: torch.Tensor, kv_cache: torch.Tensor, ctx: AttentionContext, meta: GroupMetadata
    ) -> torch.Tensor:
        """Each query over its own prefix, in the cache, by the paged kernel, which computes a (sequence,
        head) pair the same way whatever else is in its call: so a token's attention does not depend on the
        batch it is in or on where its prompt was cut into chunks (a prefill query is a decode
        query of its position)."""
        kernel, window = self.per_query_kernel, self.sliding_window or 0
        out = torch.empty_like(q)
        nd = ctx.num_decode
        if nd:
            out[:nd] = kernel(q[:nd].contiguous(), kv_cache, meta.decode_block_tables, meta.decode_seq_lens,
                              self.scale, window)
        for span in meta.prefills:
            rows = slice(span.q_start, span.q_start + span.q_len)
            first = span.context_len - span.q_len + 1  # the first query sees this many keys, itself included
            seq_lens = torch.arange(first, span.context_len + 1, dtype=torch.long, device=q.device)
            tables = span.block_table.view(1, -1).expand(span.q_len, -1).contiguous()
            out[rows] = kernel(q[rows].contiguous(), kv_cache, tables, seq_lens, self.scale, window)
        return out

    def _decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, ctx: AttentionContext, meta: GroupMetadata
    ) -> torch.Tensor:
        if ctx.decode_kernel is not None and self.softcap is None and kv_cache.dtype in KERNEL_CACHE_DTYPES:
            return ctx.decode_kernel(q.contiguous(), kv_cache, meta.decode_block_tables, meta.decode_seq_lens,
                                     self.scale, self.sliding_window or 0)
        return paged_decode_attention(
            q, kv_cache, meta.decode_block_tables, meta.decode_seq_lens, meta.decode_max_len,
            scale=self.scale, sliding_window=self.sliding_window, softcap=self.softcap, backend=ctx.backend,
        )
