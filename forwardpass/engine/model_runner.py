"""``ModelRunner.execute(SchedulerOutput) -> RunnerOutput``: batch tensors in, sampled ids out.

The runner owns the KV cache tensors, the sampler, and a mirror of each sequence it has been sent
(tokens, block tables, seeded generator): ``SchedulerOutput`` brings a sequence's full data once and
then only new block ids; sampled tokens are appended here as they are sampled. It never touches the
scheduler's request state: what it computed goes back in ``RunnerOutput``.

Layout of the flattened batch (see ``attention/context.py``): the one-token (decode) chunks first,
then each prefill chunk. Logits are computed only for rows that end a sequence's known tokens: a
prefill chunk that stops short of the prompt's end samples nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from forwardpass.attention.context import AttentionContext, PrefillSpan
from forwardpass.engine.batch import EMPTY_RUNNER_OUTPUT, NewSequence, RunnerOutput, SchedulerOutput
from forwardpass.engine.kv_cache_spec import KVCacheGroup
from forwardpass.sampling.params import SamplingParams
from forwardpass.sampling.sampler import Sampler, SamplingRow, make_generator


class BatchAdapters(Protocol):
    """Per-step adapter mapping (LoRA): which rows of the flattened batch use which adapter."""

    def begin_step(self, row_adapters: list[tuple[int, int]]) -> None:
        """``[(adapter id or 0, number of rows)]`` for each chunk, in batch order."""

    def end_step(self) -> None: ...


class CausalLM(Protocol):
    """What the runner needs of a model: hidden states of the flattened batch, logits of chosen rows."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class RoutingCounter(Protocol):
    """Reads the tokens each expert received in the last forward, per MoE layer, in one host copy."""

    def collect(self) -> tuple[tuple[int, ...], ...]: ...


@dataclass
class _RunnerSequence:
    prompt: list[int]
    output: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    lora_id: int
    block_table: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def tokens(self, start: int, end: int) -> list[int]:
        p = len(self.prompt)
        if end <= p:
            return self.prompt[start:end]
        if start >= p:
            return self.output[start - p : end - p]
        return self.prompt[start:] + self.output[: end - p]


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        groups: Sequence[KVCacheGroup],
        *,
        dtype: torch.dtype,
        device: str = "cpu",
        attention_backend: str = "sdpa",
        eos_token_ids: Sequence[int] = (),
        decode_kernel: Callable | None = None,
        adapters: BatchAdapters | None = None,
        routing: RoutingCounter | None = None,
    ):
        if len(groups) != 1:
            # Attention metadata is built for one block table per sequence; layer groups with their
            # own tables (sliding-window pages, state slots) extend AttentionContext per group.
            raise NotImplementedError("the model runner supports one KV cache group")
        self.model, self.device, self.dtype = model, device, dtype
        self.block_size = groups[0].spec.block_size
        self.attention_backend = attention_backend
        self.eos_token_ids = list(eos_token_ids)
        self.decode_kernel = decode_kernel  # fixed for the runner's lifetime: numerics never change mid-run
        self.adapters, self.routing = adapters, routing
        group = groups[0]
        num_layers = 1 + max(i for g in groups for i in g.layer_ids)
        self.kv_caches: list[torch.Tensor] = [torch.empty(0)] * num_layers
        for layer in group.layer_ids:
            # Zeroed, not empty: padded rows of a gathered decode batch are masked out, but 0 · NaN
            # garbage would still poison the weighted sum.
            self.kv_caches[layer] = torch.zeros(
                group.spec.cache_shape(group.num_blocks), dtype=dtype, device=device
            )
        self.sampler = Sampler()
        self.sequences: dict[int, _RunnerSequence] = {}

    # ----- state mirror --------------------------------------------------------------------------
    def _update_states(self, scheduled: SchedulerOutput) -> None:
        for seq_id in scheduled.finished_seq_ids:
            self.sequences.pop(seq_id, None)
        for new in scheduled.new_sequences:
            self._add(new)
        for chunk in scheduled.chunks:
            self.sequences[chunk.seq_id].block_table.extend(chunk.new_block_ids[0])

    def _add(self, new: NewSequence) -> None:
        known = self.sequences.get(new.seq_id)
        if known is not None:  # resumed after a preemption: new blocks, same generator stream
            known.block_table = []
            known.output = list(new.output_token_ids)
            return
        gen = make_generator(new.params.seed, new.sample_index) if new.params.seed is not None else None
        self.sequences[new.seq_id] = _RunnerSequence(
            list(new.prompt_token_ids), list(new.output_token_ids), new.params, gen, new.lora_id
        )

    # ----- batch construction --------------------------------------------------------------------
    def _prepare(
        self, scheduled: SchedulerOutput
    ) -> tuple[
        torch.Tensor,
        torch.Tensor,
        AttentionContext,
        list[int],
        list[tuple[int, _RunnerSequence]],
        list[tuple[int, int]],
    ]:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sampled: list[tuple[int, _RunnerSequence]] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills = []
        row_adapters: list[tuple[int, int]] = []
        row = 0
        # Plain Python ints for the per-token bookkeeping: at batch 64 a few small tensors per
        # sequence cost more than the whole decode attention of a small model.
        for chunk in scheduled.chunks:
            seq = self.sequences[chunk.seq_id]
            start, n = chunk.num_computed_tokens, chunk.num_new_tokens
            end = start + n
            table = seq.block_table
            ids.extend(seq.tokens(start, end))
            pos.extend(range(start, end))
            if n == 1:
                slots.append(table[start // bs] * bs + start % bs)
                decode_tables.append(table)
                decode_lens.append(end)
            else:
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
                prefills.append(
                    PrefillSpan(
                        q_start=row,
                        q_len=n,
                        context_len=end,
                        block_table=torch.tensor(table, dtype=torch.long, device=self.device),
                    )
                )
            if end == seq.num_tokens:
                sample_rows.append(row + n - 1)
                sampled.append((chunk.seq_id, seq))
            row_adapters.append((seq.lora_id, n))
            row += n
        ctx = AttentionContext(
            kv_caches=self.kv_caches,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            num_decode=len(decode_lens),
            prefills=prefills,
            backend=self.attention_backend,
            decode_kernel=self.decode_kernel,
        )
        if decode_lens:
            width = max(len(t) for t in decode_tables)
            padded = [t + [0] * (width - len(t)) for t in decode_tables]  # pad with any valid block id
            ctx.decode_block_tables = torch.tensor(padded, dtype=torch.long, device=self.device)
            ctx.decode_seq_lens = torch.tensor(decode_lens, dtype=torch.long, device=self.device)
            ctx.decode_max_len = max(decode_lens)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)
        return input_ids, positions, ctx, sample_rows, sampled, row_adapters

    # ----- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput:
        """Run the scheduled chunks; sample for the sequences whose known tokens are now all computed."""
        self._update_states(scheduled)
        if scheduled.is_empty:
            return EMPTY_RUNNER_OUTPUT
        input_ids, positions, ctx, sample_rows, sampled, row_adapters = self._prepare(scheduled)
        if self.adapters is not None:
            self.adapters.begin_step(row_adapters)
        try:
            hidden = self.model(input_ids, positions, ctx)
        finally:
            if self.adapters is not None:
                self.adapters.end_step()  # a direct model call later must not see this step's mapping
        routing = self.routing.collect() if self.routing is not None else None
        if not sampled:
            return RunnerOutput((), (), (), routing)
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=hidden.device)])
        rows = [SamplingRow(s.params, s.prompt, s.output, s.generator) for _, s in sampled]
        out = self.sampler(logits, rows, eos_token_ids=self.eos_token_ids)
        for (_, seq), token in zip(sampled, out.token_ids):
            seq.output.append(token)
        return RunnerOutput(tuple(i for i, _ in sampled), tuple(out.token_ids), tuple(out.logprobs), routing)
