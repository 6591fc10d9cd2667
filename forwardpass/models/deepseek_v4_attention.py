"""DeepSeek-V4 attention: sliding-window attention over one shared K=V head, plus compressed history.

Per layer (parameter names are the checkpoint's, ``model.layers.{i}.attn.*``):

* q: ``wq_a`` → RMSNorm ``q_norm`` (its output also feeds the indexer) → ``wq_b`` → an unweighted
  RMSNorm per head → interleaved rotary on the trailing ``rope_dim`` channels;
* one K=V head: ``wkv`` → RMSNorm ``norm`` → the same rotary; sliding layers use the ``main`` rotary,
  CSA / HCA layers (and their compressors and indexer) the ``compress`` one;
* compressed entries (``compressor``: ``wkv``, ``wgate``, the per-slot bias ``ape``, RMSNorm ``norm``;
  a CSA layer's ``indexer`` has its own compressor at ``index_head_dim`` plus ``wq_b`` / ``weights_proj``);
* one softmax over window keys, visible entries and the sink ``attn_sink``, the output's rotary part
  rotated back by the query position, then the grouped output projection ``wo_a`` (``o_groups``
  blocks) → ``wo_b``.

Cache (``engine/scheduling/compressed_spec.py``): the K=V vectors in the layer's sliding pages, the entries in
the compressed group (keyed by entry index), the compressor's not-yet-pooled projections in the state
slot. Each sequence of the batch is handled on its own (a reference path: see the module notes in
``attention/compressed.py``); ``ctx=None`` runs the whole input as one sequence and keeps nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from forwardpass.attention.compressed import (
    index_scores,
    pool_entries,
    rms_norm,
    rotate_interleaved,
    sink_attention,
    top_k_bias,
    visible_entries,
)
from forwardpass.attention.context import AttentionContext
from forwardpass.attention.kv_cache_interface import KVCacheSpec
from forwardpass.layers.linear import Linear
from forwardpass.layers.rotary import RotaryEmbedding
from forwardpass.models.deepseek_v4_cache_spec import layer_cache_specs
from forwardpass.models.deepseek_v4_spec import DeepseekV4Spec
from forwardpass.models.model_spec import ModelSpec


def _f32(*shape: int) -> nn.Parameter:
    """A parameter DeepSeek-V4 keeps in float32 whatever the model's dtype (norms, biases, sinks)."""
    return nn.Parameter(torch.ones(*shape, dtype=torch.float32), requires_grad=False)


class Norm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = _f32(dim)


class Compressor(nn.Module):
    """Pools ``rate`` tokens into one entry of ``dim`` values (CSA: two overlapping
    series, ``2·dim`` wide)."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool):
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.rate, self.overlap, self.width = dim, rate, overlap, width
        self.wkv = Linear(hidden, width)
        self.wgate = Linear(hidden, width)
        self.ape = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32), requires_grad=False)
        self.norm = Norm(dim)

    def entries(
        self, proj: torch.Tensor, e0: int, e1: int, rotary: RotaryEmbedding, eps: float
    ) -> torch.Tensor:
        """Entries ``e0 .. e1-1`` from ``[kv | gate]`` projections (see ``pool_entries``), normed and
        rotated at their window's first position."""
        kv, gate = proj.split(self.width, dim=-1)
        pooled = rms_norm(
            pool_entries(kv, gate, self.ape, self.rate, self.overlap, e0, e1), self.norm.weight, eps
        )
        cos, sin = rotary.cos_sin(torch.arange(e0, e1, device=proj.device) * self.rate, pooled.dtype)
        half = cos.shape[-1] // 2
        return rotate_interleaved(pooled, cos[:, :half], sin[:, :half])


class Indexer(nn.Module):
    def __init__(self, spec: ModelSpec, v4: DeepseekV4Spec, rate: int):
        super().__init__()
        self.heads, self.dim, self.top_k = v4.index_heads, v4.index_head_dim, v4.index_topk
        self.wq_b = Linear(v4.q_lora_rank, self.heads * self.dim)
        self.weights_proj = Linear(spec.hidden, self.heads)
        self.compressor = Compressor(spec.hidden, self.dim, rate, overlap=True)


@dataclass
class _Chunk:
    """One sequence's rows this step and where its caches are."""

    rows: slice
    keys: torch.Tensor | None = None  # the live window's K=V through this chunk's last token; None: the rows'
    entry_table: torch.Tensor | None = None  # compressed entries' block table
    slot: int = -1  # the compressor state's slot


class DeepseekV4Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        v4 = spec.dsv4
        assert v4 is not None
        self.v4, self.layer, self.eps = v4, layer, spec.norm.eps
        self.heads, self.dim, self.groups = spec.heads, spec.head_dim, v4.o_groups
        self.rate, self.sparse = v4.compress_rates[layer], v4.sparse(layer)
        self.wq_a = Linear(spec.hidden, v4.q_lora_rank)
        self.q_norm = Norm(v4.q_lora_rank)
        self.wq_b = Linear(v4.q_lora_rank, self.heads * self.dim)
        self.wkv = Linear(spec.hidden, self.dim)
        self.norm = Norm(self.dim)
        # multiplied group by group (below): read as a matrix, so kept plain fp32 by every plan
        self.wo_a = Linear(self.heads * self.dim // self.groups, self.groups * v4.o_lora_rank, role="dense")
        self.wo_b = Linear(self.groups * v4.o_lora_rank, spec.hidden)
        self.attn_sink = nn.Parameter(torch.zeros(self.heads, dtype=torch.float32), requires_grad=False)
        if self.rate:
            self.compressor = Compressor(spec.hidden, self.dim, self.rate, overlap=self.sparse)
            if self.sparse:
                self.indexer = Indexer(spec, v4, self.rate)

    def kv_cache_spec(self, spec: ModelSpec, block_size: int,
                      dtype: torch.dtype) -> dict[int, KVCacheSpec | None]:
        """Sliding K=V pages, compressed entries and the compressor's state
        (``models/deepseek_v4_cache_spec.py``)."""
        return layer_cache_specs(self.v4, self.layer, self.dim, block_size, dtype)

    # ----- the projections of the whole batch ---------------------------------------------------------
    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, ctx: AttentionContext | None
    ) -> torch.Tensor:
        t, half = x.shape[0], self.v4.rope_dim // 2
        cos, sin = rotary.cos_sin(positions, x.dtype)
        cos, sin = cos[:, :half], sin[:, :half]
        q_res = rms_norm(self.wq_a(x), self.q_norm.weight, self.eps)
        q = rms_norm(self.wq_b(q_res).view(t, self.heads, self.dim), None, self.eps)
        q = rotate_interleaved(q, cos[:, None], sin[:, None])
        kv = rotate_interleaved(rms_norm(self.wkv(x), self.norm.weight, self.eps), cos, sin)
        proj = self._projections(x) if self.rate else None
        out = torch.empty_like(q)
        for chunk in self._chunks(kv, ctx, t):
            out[chunk.rows] = self._attend(chunk, x, q_res, q, kv, proj, positions, rotary, ctx)
        out = rotate_interleaved(out, cos[:, None], -sin[:, None])
        grouped = out.reshape(t, self.groups, -1).transpose(0, 1)  # [g, T, H·D/g]
        w = self.wo_a.dense_weight().view(self.groups, -1, grouped.shape[-1])  # [g, o_lora_rank, H·D/g]
        return self.wo_b(torch.bmm(grouped, w.transpose(1, 2)).transpose(0, 1).reshape(t, -1))

    def _projections(self, x: torch.Tensor) -> torch.Tensor:
        """``[kv | gate]`` of the compressor (and of the indexer's) for every token: what the state keeps."""
        parts = [self.compressor.wkv(x), self.compressor.wgate(x)]
        if self.sparse:
            parts += [self.indexer.compressor.wkv(x), self.indexer.compressor.wgate(x)]
        return torch.cat(parts, dim=-1)

    def _chunks(self, kv: torch.Tensor, ctx: AttentionContext | None, t: int) -> list[_Chunk]:
        if ctx is None:
            return [_Chunk(slice(0, t))]
        cache, meta = ctx.kv_caches[self.layer], ctx.for_layer(self.layer)  # [blocks, block_size, D]: K = V
        cache.view(-1, self.dim).index_copy_(0, meta.slot_mapping, kv)
        nd = ctx.num_decode
        tables = [(meta.decode_block_tables[i], int(meta.decode_seq_lens[i])) for i in range(nd)]  # type: ignore[index]
        tables += [(p.block_table, p.context_len) for p in meta.prefills]
        rows = [(i, 1) for i in range(nd)] + [(p.q_start, p.q_len) for p in meta.prefills]
        spans = ctx.for_compressed(self.v4.entries_cache_id(self.layer)).spans if self.rate else None
        slots: list[int] = []
        if self.rate:
            state = ctx.for_state(self.v4.state_cache_id(self.layer))
            slots = state.decode_slots.tolist() + [p.slot for p in state.prefills]
        bs = cache.shape[1]
        return [
            _Chunk(
                slice(row, row + n),
                cache.index_select(0, table[: -(-length // bs)]).view(-1, self.dim)[:length],
                spans[i].block_table if spans is not None else None,
                slots[i] if slots else -1,
            )
            for i, ((row, n), (table, length)) in enumerate(zip(rows, tables))
        ]

    # ----- one sequence ------------------------------------------------------------------------------
    def _attend(
        self,
        c: _Chunk,
        x: torch.Tensor,
        q_res: torch.Tensor,
        q: torch.Tensor,
        kv: torch.Tensor,
        proj: torch.Tensor | None,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        ctx: AttentionContext | None,
    ) -> torch.Tensor:
        """Window + visible entries + sink for one sequence's rows."""
        pos = positions[c.rows]
        end = int(pos[-1]) + 1
        keys = kv[c.rows] if c.keys is None else c.keys
        key_pos = torch.arange(end - keys.shape[0], end, device=x.device)
        near = (key_pos[None] <= pos[:, None]) & (key_pos[None] > pos[:, None] - self.v4.window)
        bias = torch.zeros(near.shape, dtype=torch.float32, device=x.device).masked_fill(~near, float("-inf"))
        if proj is not None:
            start = end - (c.rows.stop - c.rows.start)
            entries = self._entries(proj[c.rows], start, end, rotary, ctx, c)
            if entries.shape[0]:
                seen = visible_entries(pos, entries.shape[0], self.rate)
                if self.sparse:
                    cmp_bias = self._index(
                        x[c.rows], q_res[c.rows], pos, entries[:, self.dim :], seen, rotary
                    )
                else:
                    cmp_bias = torch.zeros(seen.shape, device=x.device).masked_fill(~seen, float("-inf"))
                keys = torch.cat([keys, entries[:, : self.dim]])
                bias = torch.cat([bias, cmp_bias], dim=1)
        return sink_attention(q[c.rows], keys, bias, self.attn_sink, self.dim**-0.5)

    def _entries(
        self,
        proj: torch.Tensor,
        start: int,
        end: int,
        rotary: RotaryEmbedding,
        ctx: AttentionContext | None,
        c: _Chunk,
    ) -> torch.Tensor:
        """Every entry complete at ``end`` ([E, entry_dim]): pool the windows closed by this chunk from
        the carried projections plus this chunk's, store them, carry the open window(s) on."""
        m, back = self.rate, int(self.sparse)
        e0, e1 = start // m, end // m
        first = max(0, (e0 - back) * m)  # the earliest position a new entry (or the next one) still reads
        if ctx is not None and start > first:
            state = ctx.kv_caches[self.v4.state_cache_id(self.layer)][c.slot].view(-1, proj.shape[-1])
            proj = torch.cat([state[: start - first].to(proj.dtype), proj])
        new = (
            self._pool(proj, e0, e1, rotary) if e1 > e0 else proj.new_zeros(0, self.v4.entry_dim(self.layer))
        )
        if ctx is None:
            return new
        keep = max(0, (e1 - back) * m)
        if end > keep:  # the open window (and, CSA, the closed one before it) for the next chunk
            state = ctx.kv_caches[self.v4.state_cache_id(self.layer)][c.slot].view(-1, proj.shape[-1])
            state[: end - keep] = proj[keep - first :].float()
        cache = ctx.kv_caches[self.v4.entries_cache_id(self.layer)]
        bs, flat = cache.shape[1], cache.view(-1, cache.shape[-1])
        assert c.entry_table is not None
        slots = (
            c.entry_table[torch.arange(e1, device=proj.device) // bs] * bs
            + torch.arange(e1, device=proj.device) % bs
        )
        if e1 > e0:
            flat.index_copy_(0, slots[e0:], new)
        return flat.index_select(0, slots)

    def _pool(self, proj: torch.Tensor, e0: int, e1: int, rotary: RotaryEmbedding) -> torch.Tensor:
        w = 2 * self.compressor.width
        main = self.compressor.entries(proj[:, :w], e0, e1, rotary, self.eps)
        if not self.sparse:
            return main
        return torch.cat(
            [main, self.indexer.compressor.entries(proj[:, w:], e0, e1, rotary, self.eps)], dim=-1
        )

    def _index(
        self,
        x: torch.Tensor,
        q_res: torch.Tensor,
        pos: torch.Tensor,
        keys: torch.Tensor,
        seen: torch.Tensor,
        rotary: RotaryEmbedding,
    ) -> torch.Tensor:
        """The indexer's top-k of the visible entries for each query, as an additive bias."""
        ix = self.indexer
        cos, sin = rotary.cos_sin(pos, x.dtype)
        half = cos.shape[-1] // 2
        q = rotate_interleaved(
            ix.wq_b(q_res).view(-1, ix.heads, ix.dim), cos[:, None, :half], sin[:, None, :half]
        )
        weights = ix.weights_proj(x).float() * ix.heads**-0.5
        return top_k_bias(index_scores(q, keys, weights, ix.dim**-0.5), seen, ix.top_k)
