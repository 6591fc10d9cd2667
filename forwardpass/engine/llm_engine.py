"""LLMEngine: add requests, call ``step()`` until done. Everything else builds on this loop.

One ``step()`` = schedule (one token budget) → one forward pass → sample → append tokens, detokenize,
check stop conditions → return the outputs of requests that advanced. Finished and aborted requests
hand their KV blocks back at once.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from pathlib import Path

import torch

from forwardpass.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig
from forwardpass.engine.cost import StepCostModel
from forwardpass.engine.kv_cache import KVCacheManager
from forwardpass.engine.model_runner import ModelRunner, kv_bytes_per_block
from forwardpass.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from forwardpass.engine.scheduler import Scheduler
from forwardpass.engine.sequence import Sequence, SequenceStatus
from forwardpass.engine.stats import StepRecord
from forwardpass.errors import ConfigError, ContextLengthError, ValidationError
from forwardpass.layers.moe import RoutingStats
from forwardpass.loader.generation_config import GenerationDefaults, load_generation_config
from forwardpass.loader.tokenizer import IncrementalDetokenizer, Tokenizer
from forwardpass.models.loading import load_model
from forwardpass.sampling.params import SamplingParams
from forwardpass.sampling.sampler import make_generator

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, model: str | Path, config: EngineConfig | None = None, *, model_and_config=None):
        self.model_dir = Path(model)
        self.config = config = config or EngineConfig()
        dtype = config.torch_dtype
        t0 = time.perf_counter()
        self.model, self.model_config = model_and_config or load_model(self.model_dir, dtype, config.device)
        logger.info("loaded %s in %.2fs", self.model_dir, time.perf_counter() - t0)
        cfg = self.model_config
        self.tokenizer: Tokenizer | None = (
            Tokenizer.from_dir(self.model_dir) if (self.model_dir / "tokenizer.json").exists() else None
        )
        self.generation_defaults: GenerationDefaults = load_generation_config(self.model_dir, cfg)
        self.eos_token_ids = list(self.generation_defaults.eos_token_ids)
        tok_eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        if tok_eos is not None and tok_eos not in self.eos_token_ids:
            self.eos_token_ids.append(tok_eos)

        # ----- KV budget ---------------------------------------------------------------------------
        bs = config.block_size
        per_block = kv_bytes_per_block(cfg, bs, dtype)
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            num_blocks = (config.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY) // per_block
        capacity = num_blocks * bs
        max_pos = int(cfg.get("max_position_embeddings", capacity))
        if config.max_model_len is None:
            self.max_model_len = min(max_pos, capacity)
        else:
            self.max_model_len = config.max_model_len
        if self.max_model_len > capacity or num_blocks < 1:
            raise ConfigError(
                f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {bs}, {per_block} bytes each) but one "
                f"sequence of max_model_len={self.max_model_len} tokens must fit: raise kv_cache_memory / "
                f"num_kv_blocks or lower max_model_len",
                param="max_model_len",
            )
        if self.max_model_len > max_pos:
            logger.warning("max_model_len %d exceeds the model's max_position_embeddings %d",
                           self.max_model_len, max_pos)
        self.kv = KVCacheManager(num_blocks, bs, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, cfg, num_blocks, bs, dtype, config.device, config.attention_backend,
                                  cpu_kernels=config.cpu_kernels)
        self.runner.eos_token_ids = self.eos_token_ids
        torch.manual_seed(config.seed)  # unseeded requests draw from the global generator

        self.requests: dict[str, list[Sequence]] = {}
        self.prompts: dict[str, str | None] = {}
        self.stats: deque[StepRecord] = deque(maxlen=config.max_stats_records)
        self.step_counter = 0
        self.stat_listeners: list = []  # callables(StepRecord)
        try:  # FLOPs / bytes per step for achieved FLOP/s and GB/s; optional, never fatal
            self.cost_model = StepCostModel(cfg, torch.empty((), dtype=dtype).element_size())
        except Exception as exc:  # noqa: BLE001 - an exotic config the analyzer can't read
            logger.warning("no FLOP/byte accounting for this model: %s", exc)
            self.cost_model = None
        # MoE models: per-step tokens per expert per layer (deque of RoutingRecord, step ids as in
        # self.stats), filled by a runner.last_forward_hook; None for models without MoE layers.
        self.routing_stats = RoutingStats.attach(self, config.max_stats_records)

    # ----- requests ------------------------------------------------------------------------------
    def default_sampling_params(self) -> SamplingParams:
        d = self.generation_defaults
        kwargs = {k: v for k, v in (("temperature", d.temperature), ("top_p", d.top_p), ("top_k", d.top_k),
                                    ("min_p", d.min_p), ("repetition_penalty", d.repetition_penalty)) if v is not None}
        return SamplingParams(**kwargs)

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValidationError(f"{self.model_dir} has no tokenizer.json: pass prompt token ids instead of text")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None, *,
                    lora_request=None, arrival_time: float | None = None) -> None:
        if request_id in self.requests:
            raise ValidationError(f"request id {request_id!r} is already in use", param="request_id")
        params = params or self.default_sampling_params()
        token_ids = self.encode_prompt(prompt)
        if not token_ids:
            raise ValidationError("the prompt is empty", param="prompt")
        vocab = self.model_config["vocab_size"]
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in token_ids):
            raise ValidationError(f"prompt token ids must be integers in [0, {vocab})", param="prompt")
        if len(token_ids) >= self.max_model_len:
            raise ContextLengthError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(token_ids)} tokens and at least one token must be generated",
                param="prompt",
            )
        self.validate_lora(lora_request)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        seqs = []
        for i in range(params.n):
            seq = Sequence(request_id, token_ids, params, index=i, lora_request=lora_request, arrival_time=arrival,
                           generator=make_generator(params.seed, i) if params.seed is not None else None)
            if self.tokenizer is not None:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
            seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = seqs
        self.prompts[request_id] = prompt if isinstance(prompt, str) else None

    def validate_lora(self, lora_request) -> None:
        if lora_request is not None:
            raise ValidationError("this engine was not started with LoRA enabled (enable_lora=True)", param="lora")

    def abort(self, request_id: str | list[str]) -> None:
        """Stop a request now and return its KV blocks to the pool. Unknown ids are ignored."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            for seq in self.requests.pop(rid, []):
                if not seq.is_finished:
                    self.scheduler.finish(seq)
                    seq.finish_reason = "abort"
            self.prompts.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ----- the step ------------------------------------------------------------------------------
    def step(self, only_finished: bool = False) -> list[RequestOutput]:
        """One forward pass. Returns the outputs of requests that advanced (all of them for streaming
        callers; ``only_finished=True`` skips building outputs nobody reads, as ``LLM.generate`` does)."""
        start = time.monotonic()
        batch = self.scheduler.schedule()
        touched: dict[str, None] = {}
        num_prefill = num_decode = 0
        spans = [(seq.num_computed_tokens, n) for seq, n in zip(batch.seqs, batch.num_new_tokens)]
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            # a one-token step of a sequence that has generated before is a decode step
            if n == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens:
                num_decode += 1
            else:
                num_prefill += n
        sampled, out = ([], None) if not batch.seqs else self.runner.execute(batch)
        now = time.monotonic()
        for i, seq in enumerate(sampled):
            self._append(seq, out.token_ids[i], out.logprobs[i], now)
            touched[seq.request_id] = None
        outputs = [self._make_output(rid) for rid in touched if rid in self.requests
                   and (not only_finished or all(s.is_finished for s in self.requests[rid]))]
        for o in outputs:
            if o.finished:
                del self.requests[o.request_id]
                self.prompts.pop(o.request_id, None)
        self.step_counter += 1
        record = StepRecord(
            step=self.step_counter, start_time=start, duration_s=time.monotonic() - start,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_seqs_scheduled=len(batch), num_prefill_tokens=num_prefill, num_decode_tokens=num_decode,
            num_sampled=len(sampled), kv_usage=self.kv.usage, num_free_blocks=self.kv.num_free_blocks,
            prefix_cache_queries=self.kv.prefix_queries, prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=batch.num_preempted, total_preemptions=self.scheduler.num_preemptions,
        )
        if self.cost_model is not None:
            record.flops, record.bytes = self.cost_model.step(spans, len(sampled))
        self.stats.append(record)
        for listener in self.stat_listeners:
            listener(record)
        return outputs

    def _append(self, seq: Sequence, token: int, logprobs, now: float) -> None:
        seq.append_token(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        if seq.detokenizer is not None:
            seq.output_text += seq.detokenizer.add(token)
        reason, stop = self._check_stop(seq, token)
        if reason is not None:
            if seq.detokenizer is not None and not isinstance(stop, str):
                seq.output_text += seq.detokenizer.flush()  # text held back for an incomplete character
            seq.finish_reason, seq.stop_reason = reason, stop
            seq.finished_time = now
            self.scheduler.finish(seq)

    def _check_stop(self, seq: Sequence, token: int) -> tuple[str | None, int | str | None]:
        p = seq.params
        n_out = len(seq.output_token_ids)
        if n_out >= p.min_tokens:  # no stop condition counts before min_tokens
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop", None
            if p.stop_token_ids and token in p.stop_token_ids:
                return "stop", token
            if p.stop and seq.detokenizer is not None:
                hit = self._find_stop_string(seq)
                if hit is not None:
                    return "stop", hit
        if p.max_tokens is not None and n_out >= p.max_tokens:
            return "length", None
        if seq.num_tokens >= self.max_model_len:
            return "length", None
        return None, None

    @staticmethod
    def _find_stop_string(seq: Sequence) -> str | None:
        """Look for a stop string in the text added since last time (plus overlap); truncate there."""
        text, p = seq.output_text, seq.params
        window = max(len(s) for s in p.stop) + 16
        search_from = max(0, len(text) - window)
        best = None
        for s in p.stop:
            idx = text.find(s, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        seq.output_text = text[: idx + len(s)] if p.include_stop_str_in_output else text[:idx]
        return s

    def _visible_text(self, seq: Sequence) -> str:
        """While running, hold back a tail that could still turn out to be the start of a stop string."""
        if seq.is_finished or not seq.params.stop:
            return seq.output_text
        hold = max(len(s) for s in seq.params.stop) - 1
        return seq.output_text[: len(seq.output_text) - hold] if hold > 0 else seq.output_text

    def _logprob_dicts(self, seq: Sequence) -> list[dict[int, Logprob]] | None:
        """vLLM-shaped logprobs, converted once per token (cached on the sequence), not once per step."""
        if seq.params.logprobs is None:
            return None
        cache = seq.logprob_dicts
        decode = (lambda t: self.tokenizer.decode([t], skip_special_tokens=False)) if self.tokenizer else (lambda t: None)
        for lp in seq.logprobs[len(cache):]:
            d = {lp.token_id: Logprob(lp.logprob, lp.rank, decode(lp.token_id))}
            for rank, (tid, val) in enumerate(lp.top, start=1):
                d.setdefault(tid, Logprob(val, rank, decode(tid)))
            cache.append(d)
        return list(cache)

    def _make_output(self, request_id: str) -> RequestOutput:
        seqs = self.requests[request_id]
        completions = []
        for seq in seqs:
            lps = self._logprob_dicts(seq)
            completions.append(CompletionOutput(
                index=seq.index, text=self._visible_text(seq), token_ids=list(seq.output_token_ids),
                cumulative_logprob=sum(lp.logprob for lp in seq.logprobs) if seq.logprobs else None,
                logprobs=lps, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            ))
        first = seqs[0]
        metrics = RequestMetrics(
            arrival_time=first.arrival_time, first_scheduled_time=first.first_scheduled_time,
            first_token_time=min((s.first_token_time for s in seqs if s.first_token_time), default=None),
            last_token_time=max((s.last_token_time for s in seqs if s.last_token_time), default=None),
            finished_time=max(s.finished_time or 0 for s in seqs) if all(s.is_finished for s in seqs) else None,
            num_cached_tokens=first.num_cached_tokens, num_preemptions=sum(s.num_preemptions for s in seqs),
        )
        return RequestOutput(
            request_id=request_id, prompt=self.prompts.get(request_id), prompt_token_ids=list(first.prompt_token_ids),
            outputs=completions, finished=all(s.is_finished for s in seqs), metrics=metrics,
            num_cached_tokens=first.num_cached_tokens,
        )

    # ----- invariants ----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        self.kv.check_invariants([*self.scheduler.running, *self.scheduler.waiting])
        for seq in self.scheduler.waiting:
            assert seq.status is SequenceStatus.WAITING and not seq.block_table, "a waiting sequence holds blocks"
        if not self.has_unfinished_requests():
            assert self.kv.num_free_blocks == self.kv.num_blocks, "all requests are done but blocks are still owned"
