"""Turns a scheduled batch into tensors, runs one forward pass, and samples the next tokens.

Layout of the flattened batch (see ``attention/context.py``): the one-token (decode) sequences first,
then each prefill chunk. Logits are computed only for rows that end a sequence's known tokens: a
prefill chunk that stops short of the prompt's end samples nothing.
"""

from __future__ import annotations

import time

import torch

from forwardpass.attention.context import AttentionContext, PrefillSpan
from forwardpass.engine.scheduler import ScheduledBatch
from forwardpass.engine.sequence import Sequence
from forwardpass.loader.config import ModelConfig
from forwardpass.sampling.sampler import Sampler, SamplerOutput, SamplingRow


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg["num_hidden_layers"] * block_size * cfg["num_key_value_heads"] * cfg["head_dim"] * elem


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: str = "cpu", attention_backend: str = "sdpa",
                 cpu_kernels: bool | str = "auto"):
        self.model, self.cfg = model, cfg
        self.block_size, self.device, self.dtype = block_size, device, dtype
        self.attention_backend = attention_backend
        shape = (2, num_blocks, block_size, cfg["num_key_value_heads"], cfg["head_dim"])
        # Zeroed, not empty: padded rows of a gathered decode batch are masked out, but 0 · NaN
        # garbage would still poison the weighted sum.
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg["num_hidden_layers"])]
        self.sampler = Sampler()
        # The compiled paged-decode kernel serves fp32 CPU decode unless the naive reference is asked for.
        # cpu_kernels=True waits for a first-time build (~30 s); "auto" never waits: it uses the PyTorch
        # path until a background build is done (checked once a second).
        self.decode_kernel = None
        self._kernel_mode = cpu_kernels if device == "cpu" and dtype == torch.float32 else False
        if attention_backend == "naive":
            self._kernel_mode = False
        self._kernel_checked = 0.0
        self._poll_kernel()
        self.eos_token_ids: list[int] = []
        self.last_forward_hook = None  # callable(model_ctx) for observers (e.g. MoE routing stats)
        # callable(batch, ctx) run just before the forward, e.g. LoRA's row -> adapter mapping
        # (forwardpass/lora/manager.py); rows are laid out in batch.seqs order, num_new_tokens each
        self.before_forward_hook = None

    def _poll_kernel(self) -> None:
        if self._kernel_mode is False or self.decode_kernel is not None:
            return
        now = time.monotonic()
        if now - self._kernel_checked < 1.0:
            return
        self._kernel_checked = now
        from forwardpass.attention.cpu_kernel import load_paged_decode

        self.decode_kernel = load_paged_decode(wait=self._kernel_mode is True)
        if self.decode_kernel is None and self._kernel_mode is True:
            self._kernel_mode = False  # the build failed (already logged): stop asking

    # ----- batch construction --------------------------------------------------------------------
    def _prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionContext, list[int]]:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills = []
        row = 0
        # Plain Python ints for the per-token bookkeeping: at batch 64 a few small tensors per
        # sequence cost more than the whole decode attention of a small model.
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            end = start + n
            table = seq.block_table
            ids.extend(seq.token_ids[start:end])
            pos.extend(range(start, end))
            if n == 1:
                slots.append(table[start // bs] * bs + start % bs)
                decode_tables.append(table)
                decode_lens.append(end)
            else:
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
                prefills.append(PrefillSpan(q_start=row, q_len=n, context_len=end,
                                            block_table=torch.tensor(table, dtype=torch.long, device=self.device)))
            if end == seq.num_tokens:
                sample_rows.append(row + n - 1)
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
        return input_ids, positions, ctx, sample_rows

    # ----- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], SamplerOutput | None]:
        """Run the batch; return the sequences that got a new token and the sampler's output for them.

        Advances ``num_computed_tokens`` of every scheduled sequence (the caller appends tokens)."""
        self._poll_kernel()
        input_ids, positions, ctx, sample_rows = self._prepare(batch)
        if self.before_forward_hook is not None:
            self.before_forward_hook(batch, ctx)
        hidden = self.model(input_ids, positions, ctx)
        if self.last_forward_hook is not None:
            self.last_forward_hook(ctx)
        sampled: list[Sequence] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                sampled.append(seq)
        if not sampled:
            return [], None
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=hidden.device)])
        rows = [SamplingRow(s.params, s.prompt_token_ids, s.output_token_ids, s.generator) for s in sampled]
        return sampled, self.sampler(logits, rows, eos_token_ids=self.eos_token_ids)
