"""The draft's lean forward: a few decode rows through its decode stack, without the engine's step machinery.

A draft pays only if its forward pass is a small fraction of the target's step (docs/speculative.md). The
draft of the embedded model computes a token in ~0.2 ms of kernels (three small layers, the tied head), and
the generic path around them (a metadata builder per call, block tables and lengths rebuilt from Python
lists, the packed embedding's gather, rotary angles recomputed, a 2-token catch-up through the prefill
modules) cost as much again. ``DraftStepper`` keeps what does not change between calls:

* the embedding rows (every id's row computed once through the model's own lookup; a small table) and the
  rotary ``cos``/``sin`` of every position the draft can reach (computed once by the model's rotary);
* each cache group's block table as a tensor of ``max_rows`` identical rows, rewritten only when the
  sequence's table changes (a new block every ``block_size`` tokens, another sequence);

and runs each call's ``n`` tokens as ``n`` decode rows (row ``i`` a query over positions ``..start + i``:
the stack writes a layer's K/V for all rows before its attention), so the 1-2 token catch-up after a verify
takes the decode stack too. It calls the same kernels the module path calls; ``tests/test_speculative_draft``
checks its logits against the model's own forward.

Only where that is exactly the model's computation: a plain Llama-family decoder with a decode stack
(``models/llama_decode_stack.py``), full-attention paged groups (no sliding window: a window frees leading
blocks). Anything else returns None from :meth:`DraftStepper.build` and the proposer keeps the generic path.
"""

from __future__ import annotations

from typing import Any

import torch

from forwardpass.attention.context import AttentionContext, GroupMetadata
from forwardpass.attention.kv_cache_interface import FullAttentionSpec
from forwardpass.engine.speculative.draft_cache import DraftKVCache, DraftSequence
from forwardpass.models.decoder import DecoderModel

#: embedding tables larger than this stay behind the model's own lookup (a big draft's vocabulary)
_MAX_TABLE_BYTES = 64 << 20
#: positions whose rotary angles are kept; later ones are computed per call (a long-context draft)
_MAX_ROPE_POSITIONS = 8192


class DraftStepper:
    def __init__(self, model: Any, cache: DraftKVCache, max_len: int, max_rows: int, decode_kernel: Any):
        decoder = model.model
        self.model, self.decoder, self.cache = model, decoder, cache
        self.stack = decoder.decode_stack
        self.max_rows, self.max_len = max_rows, max_len
        self.block_size = cache.groups[0].spec.block_size
        with torch.inference_mode():
            ids = torch.arange(model.spec.vocab)
            table_bytes = model.spec.vocab * model.spec.hidden * 4
            self.embedding = decoder.embed(ids).contiguous() if table_bytes <= _MAX_TABLE_BYTES else None
            cos, sin = decoder.rotary.cos_sin(torch.arange(min(max_len, _MAX_ROPE_POSITIONS)), torch.float32)
            self.cos, self.sin = cos.contiguous(), sin.contiguous()
        width = -(-max_len // self.block_size)
        self.tables = [torch.zeros(max_rows, width, dtype=torch.long) for _ in cache.groups]
        self.written: list[list[int] | None] = [None] * len(cache.groups)  # the table each tensor now holds
        # a call's ids, and per group its slots and lengths, written in place through numpy views
        self.ids = torch.zeros(max_rows, dtype=torch.long)
        self.slots = [torch.zeros(max_rows, dtype=torch.long) for _ in cache.groups]
        self.lens = [torch.zeros(max_rows, dtype=torch.long) for _ in cache.groups]
        self.meta = [GroupMetadata(slot_mapping=self.slots[g]) for g in range(len(cache.groups))]
        self.writable = [(s.numpy(), n.numpy()) for s, n in zip(self.slots, self.lens)]
        self.ids_np = self.ids.numpy()
        self.ctx = AttentionContext(kv_caches=cache.kv_caches, groups=self.meta,  # type: ignore[arg-type]
                                    layer_group=cache.layer_group, num_decode=0, decode_kernel=decode_kernel)

    @classmethod
    def build(cls, model: Any, cache: DraftKVCache, max_len: int | None,
              decode_kernel: Any) -> DraftStepper | None:
        """The stepper for ``model``, or None where its decode step is not the decode stack over
        full-attention paged groups (the proposer then runs the model's own forward)."""
        decoder = getattr(model, "model", None)
        stack = getattr(decoder, "decode_stack", None)
        if (type(decoder) is not DecoderModel or stack is None or decoder.rotary is None or not max_len
                or decode_kernel is None or getattr(model, "vocab_parallel", False)
                or any(type(g.spec) is not FullAttentionSpec for g in cache.groups)):
            return None
        return cls(model, cache, max_len, stack.max_rows, decode_kernel)

    def applies(self, state: DraftSequence, feed: list[int]) -> bool:
        return 0 < len(feed) <= self.max_rows and len(state.tokens) + len(feed) <= self.max_len

    def run(self, state: DraftSequence, feed: list[int]) -> torch.Tensor:
        """Run ``feed`` (blocks already reserved) after ``state.tokens`` as decode rows; the last row's
        float32 logits ``[vocab]``."""
        n, start = len(feed), len(state.tokens)
        end, bs = start + n, self.block_size
        for g, table in enumerate(state.tables):
            if self.written[g] != table:
                self.tables[g][:, : len(table)] = torch.tensor(table, dtype=torch.long)
                self.written[g] = list(table)
            slots, lens = self.writable[g]
            for i, p in enumerate(range(start, end)):
                slots[i] = table[p // bs] * bs + p % bs
                lens[i] = p + 1
            meta = self.meta[g]
            meta.slot_mapping, meta.decode_block_tables = self.slots[g][:n], self.tables[g][:n]
            meta.decode_seq_lens, meta.decode_max_len = self.lens[g][:n], end
        self.ctx.num_decode = n
        self.ids_np[:n] = feed
        ids = self.ids[:n]
        x = self.embedding.index_select(0, ids) if self.embedding is not None else self.decoder.embed(ids)
        if end <= self.cos.shape[0]:
            cos, sin = self.cos[start:end], self.sin[start:end]
        else:
            cos, sin = self.decoder.rotary.cos_sin(torch.arange(start, end), torch.float32)
        hidden = self.stack(x, cos, sin, self.ctx)
        state.tokens.extend(feed)
        return self.model.compute_logits(self.decoder.norm.forward(hidden[-1:]))[0]
