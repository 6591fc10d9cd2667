"""``method: mtp``: the checkpoint's own next-token-prediction layer (DeepSeek-V3's MTP) proposes the drafts.

The MTP layer (``models/deepseek_mtp.py``) reads, at position ``i``, the target's hidden state ``h_i`` and the
token ``t_{i+1}``, and predicts ``t_{i+2}``. It runs beside the scheduler as the draft model does
(``draft.py``: the ``Speculator`` asks ``propose_for``), in two parts:

1. **catch up**: the positions from the end of its cache to ``L - 2`` (``L`` tokens known; the target has
   computed ``0 .. L - 2``) run in one pass, with the target's hidden states the runner left in the stash
   (``mtp_stash.py``) and the tokens that followed them; its output at ``L - 2`` gives the first draft;
2. **chain**: each further draft runs the same layer one position on, on its own last output and the draft
   it just made (vLLM reuses its one MTP layer this way for ``k`` beyond ``num_nextn_predict_layers``).

Its KV cache is the draft model's machinery (``draft_cache.py``: paged, a private pool). Entries made from the
target's hidden states are final (positions below the computed length never change); the chain's entries
are scratch and are cut as soon as the drafts are made, so a rejection needs no rollback message. A finished
or preempted sequence's blocks and stash go back through ``release``. Drafts are the argmax, or drawn from
``q`` for sampled requests (the full rejection rule of ``draft_verify.py``), as the draft model's.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from forwardpass.attention.context import AttentionContext
from forwardpass.engine.speculative.draft import Drafting, DraftModelProposer, DraftTokens, samples_from_q
from forwardpass.engine.speculative.draft_cache import DraftKVCache, DraftSequence
from forwardpass.engine.speculative.mtp_stash import HiddenStash

#: positions of hidden states a sequence that is not proposing may hold before the layer reads them anyway
MAX_PENDING = 32


class MTPProposer(DraftModelProposer):
    def __init__(self, mtp: Any, target: Any, cache: DraftKVCache, *, device: str,
                 attention_backend: str = "sdpa", decode_kernel: Any = None, max_len: int | None = None):
        super().__init__(mtp, cache, device=device, attention_backend=attention_backend,
                         decode_kernel=decode_kernel, max_len=max_len)
        self.layer = mtp.layer
        # the main model's embedding, rotary table and LM head, unless the checkpoint gave the layer its own
        self.embed = self.layer.embed_tokens or target.decoder.embed
        self.rotary = target.decoder.rotary
        self.head = self.layer.shared_head.head or target.compute_logits
        self.stash = HiddenStash()  # filled by the runner (its hidden_sink)

    @torch.inference_mode()
    def propose_for(self, seq: Drafting, k: int) -> DraftTokens:
        """Up to ``k`` drafts to follow ``seq.token_ids``."""
        tokens = seq.token_ids
        if k < 1 or len(tokens) < 2 or (self.max_len is not None and len(tokens) + k > self.max_len):
            return DraftTokens(())
        t0 = time.perf_counter()
        state = self.cache.sequence(seq.seq_id)
        out = self.catch_up(seq)
        if out is None:
            return DraftTokens(())
        final = len(state.tokens)
        sampled = samples_from_q(seq.params)
        gen = self._generator(seq) if sampled else None
        drafts: list[int] = []
        probs: list[torch.Tensor] = []
        for i in range(k):
            drafts.append(self._draw(self.logits(out), seq, gen, probs if sampled else None))
            if i + 1 == k or (chained := self.run_layer(state, final + i, [drafts[-1]], out[None])) is None:
                break  # k drafts, or the pool is full: the drafts so far
            out = chained[-1]
        self.cache.truncate(state, final)  # the chain's entries are scratch
        seconds = (time.perf_counter() - t0) / len(drafts)
        old = self.seconds_per_draft
        self.seconds_per_draft = seconds if not old else 0.8 * old + 0.2 * seconds
        return DraftTokens(drafts, torch.stack(probs) if sampled else None)

    def catch_up(self, seq: Drafting) -> torch.Tensor | None:
        """Run the layer over the positions the target computed since the last call; its output at the
        last one (``L - 2``, ``[H]``), or None when the pool has no room (the sequence then starts over)."""
        state = self.cache.sequence(seq.seq_id)
        hi = len(seq.token_ids) - 1  # entries 0 .. hi - 1: position i reads h_i and t_{i+1}
        if hi < 1:
            return None
        lo = min(len(state.tokens), hi - 1)  # at least the last again: its output is the first draft
        self.cache.truncate(state, lo)
        like = self.layer.enorm.weight
        hidden = self.stash.take(seq.seq_id, lo, hi, like)
        out = self.run_layer(state, lo, list(seq.token_ids[lo + 1 : hi + 1]), hidden)
        if out is None:
            self.release(seq.seq_id)
            return None
        return out[-1]

    def keep_up(self, seq: Drafting) -> None:
        """A sequence that proposes nothing this step: the layer reads its hidden states anyway once more than
        ``MAX_PENDING`` positions wait (a sequence that never proposes would hold them all)."""
        if self.stash.pending(seq.seq_id) > MAX_PENDING:
            with torch.inference_mode():
                self.catch_up(seq)

    def run_layer(self, state: DraftSequence, start: int, next_tokens: list[int],
                  previous: torch.Tensor) -> torch.Tensor | None:
        """The layer at positions ``start ..`` (one per token of ``next_tokens``), its K/V cached; its outputs
        ``[n, H]`` before ``shared_head.norm``; None (nothing run) when the pool has no room."""
        end = start + len(next_tokens)
        if not self.cache.reserve(state, end):
            return None
        builders = [g.spec.metadata_builder(self.device) for g in self.cache.groups]
        for builder, table in zip(builders, state.tables):
            builder.add(table, start, end, 0)
        ctx = AttentionContext(kv_caches=self.cache.kv_caches, groups=[b.build() for b in builders],
                               layer_group=self.cache.layer_group, num_decode=int(end - start == 1),
                               backend=self.attention_backend, decode_kernel=self.decode_kernel)
        ids = torch.tensor(next_tokens, dtype=torch.long, device=self.device)
        embeds = self.embed(ids)
        cos, sin = self.rotary.cos_sin(torch.arange(start, end, device=self.device), embeds.dtype)
        out = self.layer(embeds, previous, cos, sin, ctx)
        state.tokens.extend(next_tokens)
        self.num_forwards += 1
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[V]`` of one output row: ``shared_head.norm``, then the head."""
        return self.head(self.layer.shared_head.norm(hidden[None]))[0].float()

    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        self.stash.drop(seq_id)

