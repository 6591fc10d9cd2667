"""``ModelRunner.execute(SchedulerOutput) -> RunnerOutput``: batch tensors in, sampled ids out.

The runner owns the KV cache tensors, the sampler, and a mirror of each sequence it has been sent (tokens,
block tables, seeded generator): ``SchedulerOutput`` brings a sequence's full data once and then only new
block ids; sampled tokens are appended here as they are sampled. It never touches the scheduler's request
state: what it computed goes back in ``RunnerOutput``.

Layout of the flattened batch (``attention/context.py``): the one-token (decode) chunks first, then each
prefill chunk. Logits only for rows that end a sequence's known tokens (a prefill chunk short of the prompt's
end samples nothing). A chunk with draft tokens (speculative decoding) is ``[last token, drafts...]``: logits
at every one of its positions, sampled and verified by ``sample_step.py`` (with the ``DraftVerifier`` it was
handed); block tables are cut back after rejections as the scheduler cuts its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from forwardpass import huge_pages
from forwardpass.attention.context import AttentionContext
from forwardpass.attention.metadata import MetadataBuilder
from forwardpass.engine.scheduling.batch import (
    EMPTY_RUNNER_OUTPUT,
    NewSequence,
    RunnerOutput,
    SchedulerOutput,
)
from forwardpass.engine.scheduling.kv_cache_spec import KVCacheGroup, trim_table
from forwardpass.engine.worker.encoder_step import run_encoders
from forwardpass.engine.worker.isolation import drop_unloadable
from forwardpass.engine.worker.plugins import BatchAdapters, CausalLM, HiddenStateSink, RoutingCounter
from forwardpass.engine.worker.prompt_logprobs import add_prompt_logprobs
from forwardpass.engine.worker.sample_step import DraftVerifier, SampleTarget, sample_step
from forwardpass.sampling.params import SamplingParams
from forwardpass.sampling.sampler import Sampler, TokenLogprobs, make_generator
from forwardpass.structured.backend import GrammarBackend, GrammarState


@dataclass
class _RunnerSequence:
    prompt: list[int]
    output: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    lora_id: int
    block_tables: list[list[int]] = field(default_factory=list)  # one per KV cache group
    grammar: GrammarState | None = None  # structured output: matcher of the tokens generated so far
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # being collected (prompt_logprobs.py)
    # encoder–decoder models: the request's features (encoder_step.py)
    encoder_input: torch.Tensor | None = None

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
        grammars: GrammarBackend | None = None,
        hidden_sink: HiddenStateSink | None = None,  # speculative mtp: every forward's hidden states
        verifier: DraftVerifier | None = None,  # speculative decoding: the rule for rows with drafts
    ):
        self.model, self.device, self.dtype = model, device, dtype
        self.groups = list(groups)  # each with its own block pool, tables and attention metadata
        self.attention_backend, self.eos_token_ids = attention_backend, list(eos_token_ids)
        self.decode_kernel = decode_kernel  # fixed for the runner's lifetime: numerics never change mid-run
        self.adapters, self.routing, self.hidden_sink = adapters, routing, hidden_sink
        self.verifier = verifier  # only a step with drafts asks it (sample_step.py)
        self.grammars = grammars  # structured output: compiled grammars and token bitmasks
        num_layers = 1 + max(i for g in groups for i in g.layer_ids)  # layers in no group cache nothing
        self.kv_caches: list[torch.Tensor] = [torch.empty(0)] * num_layers
        self.layer_group = [0] * num_layers
        for g, group in enumerate(groups):
            for layer in group.layer_ids:
                # Zeroed, not empty: padded rows of a gathered decode batch are masked out, but 0 · NaN
                # garbage would still poison the weighted sum.
                shape = group.spec.cache_shape(group.num_blocks)
                # states keep their own dtype, K/V pages the engine's kv_cache_dtype (the model's by default)
                cache_dtype = group.spec.cache_dtype(dtype)
                if str(device) == "cpu" and huge_pages.enabled():  # each step reads it all: 2 MB pages
                    self.kv_caches[layer] = huge_pages.zeros_on_huge_pages(shape, cache_dtype)
                else:
                    self.kv_caches[layer] = torch.zeros(shape, dtype=cache_dtype, device=device)
                self.layer_group[layer] = g
        self.sampler = Sampler()
        self.sequences: dict[int, _RunnerSequence] = {}

    # ----- state mirror --------------------------------------------------------------------------
    def _update_states(self, scheduled: SchedulerOutput) -> None:
        for seq_id in scheduled.finished_seq_ids:
            self.sequences.pop(seq_id, None)
        for new in scheduled.new_sequences:
            self._add(new)
        for chunk in scheduled.chunks:
            for table, new_ids in zip(self.sequences[chunk.seq_id].block_tables, chunk.new_block_ids):
                table.extend(new_ids)

    def _add(self, new: NewSequence) -> None:
        known = self.sequences.get(new.seq_id)
        if known is not None:  # resumed after a preemption: new blocks, same generator stream
            known.block_tables = [[] for _ in self.groups]
            known.output = list(new.output_token_ids)
            return
        gen = make_generator(new.params.seed, new.sample_index) if new.params.seed is not None else None
        self.sequences[new.seq_id] = _RunnerSequence(
            list(new.prompt_token_ids), list(new.output_token_ids), new.params, gen, new.lora_id,
            [[] for _ in self.groups], encoder_input=new.encoder_input,
            prompt_logprobs=[None] if new.params.prompt_logprobs is not None else None,
        )

    # ----- batch construction --------------------------------------------------------------------
    def _prepare(
        self, scheduled: SchedulerOutput
    ) -> tuple[
        torch.Tensor,
        torch.Tensor,
        AttentionContext,
        list[int],
        list[SampleTarget],
        list[tuple[int, int]],
    ]:
        ids: list[int] = []
        pos: list[int] = []
        sample_rows: list[int] = []
        sampled: list[SampleTarget] = []
        row_adapters: list[tuple[int, int]] = []
        # each group's spec names the builder of its attention metadata (paged, state slot,
        # compressed entries, ...)
        builders: list[MetadataBuilder] = [g.spec.metadata_builder(self.device) for g in self.groups]
        num_decode = row = 0
        for chunk in scheduled.chunks:
            seq = self.sequences[chunk.seq_id]
            start, n = chunk.num_computed_tokens, chunk.num_new_tokens
            end = start + n
            ids.extend(seq.tokens(start, end))  # the known tokens, then any drafts to verify
            ids.extend(drafts := chunk.draft_token_ids)
            pos.extend(range(start, end))
            # a verify chunk among the decode rows: each position a decode query over its own prefix, so the
            # step keeps the decode kernels (the decode stack) and each row rounds as in a decode step
            as_decode = n == 1 or (n == 1 + len(drafts) and row == num_decode)
            for builder, table in zip(builders, seq.block_tables):
                if as_decode:
                    for i in range(n):
                        builder.add(table, start + i, start + i + 1, row + i)
                else:
                    builder.add(table, start, end, row)
            num_decode += n if as_decode else 0
            if end - len(drafts) == seq.num_tokens:
                sampled.append(SampleTarget(chunk.seq_id, seq, len(sample_rows), drafts))
                sample_rows.extend(range(row + n - 1 - len(drafts), row + n))
            row_adapters.append((seq.lora_id, n))
            row += n
        ctx = AttentionContext(
            kv_caches=self.kv_caches,
            groups=[b.build() for b in builders],
            layer_group=self.layer_group,
            num_decode=num_decode,
            backend=self.attention_backend,
            decode_kernel=self.decode_kernel,
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)
        return input_ids, positions, ctx, sample_rows, sampled, row_adapters

    # ----- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput:
        """Run the scheduled chunks; sample for the sequences whose known tokens are now all computed."""
        self._update_states(scheduled)
        # their requests fail
        scheduled, unloadable = drop_unloadable(scheduled, self.sequences, self.adapters)
        out = self._run(scheduled)
        return replace(out, failed=unloadable + out.failed) if unloadable else out

    def _run(self, scheduled: SchedulerOutput) -> RunnerOutput:
        if scheduled.is_empty:
            return EMPTY_RUNNER_OUTPUT
        input_ids, positions, ctx, sample_rows, sampled, row_adapters = self._prepare(scheduled)
        # encoder–decoder models: the encoder of each request starting now fills its cross-attention slot
        run_encoders(self.model, scheduled.chunks, self.sequences, self.groups, self.kv_caches, self.dtype)
        if self.adapters is not None:
            self.adapters.begin_step(row_adapters)
        try:
            hidden = self.model(input_ids, positions, ctx)
        finally:
            if self.adapters is not None:
                self.adapters.end_step()  # a direct model call later must not see this step's mapping
        routing = self.routing.collect() if self.routing is not None else None
        if self.hidden_sink is not None:  # speculative mtp: its layer drafts from these hidden states
            self.hidden_sink.record_hidden(scheduled.chunks, hidden)
        if any(self.sequences[c.seq_id].prompt_logprobs is not None for c in scheduled.chunks):
            add_prompt_logprobs(self.model.compute_logits, hidden, scheduled.chunks, self.sequences)
        if not sampled:
            return RunnerOutput((), (), (), routing)
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=hidden.device)])
        out = sample_step(self.sampler, self.grammars, self.eos_token_ids, logits, sampled, self.verifier)
        for target in sampled:  # rejected drafts: the blocks past the new length go, as in the scheduler
            for group, table in zip(self.groups, target.seq.block_tables if target.drafts else ()):
                trim_table(table, group.spec, target.seq.num_tokens)
        return RunnerOutput(tuple(out.seq_ids), tuple(out.token_ids), tuple(out.logprobs), routing,
                            tuple(out.failed), tuple(out.prompt_logprobs))
