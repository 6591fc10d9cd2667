"""``EngineCore``: the step loop's body — schedule, run, update — and nothing about text.

It takes token ids and gives back ``TokenDelta``s; tokenization, detokenization and stop strings live
in the front end (``LLMEngine`` / ``AsyncLLMEngine`` with their ``OutputProcessor``). Everything that
decides a step's numerics (dtype, attention backend, decode kernel) is fixed here at construction.
Built by :func:`forwardpass.engine.builder.build_engine_core`, which wires the optional plug-ins
(LoRA, MoE routing counts, cost model) into the constructors.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from forwardpass.config import EngineConfig
from forwardpass.engine.scheduling.batch import RunnerOutput, SchedulerOutput, TokenDelta
from forwardpass.engine.scheduling.cost import StepCost
from forwardpass.engine.scheduling.kv_cache import KVCacheManager
from forwardpass.engine.scheduling.scheduler import Scheduler
from forwardpass.engine.scheduling.sequence import Sequence, SequenceStatus
from forwardpass.engine.scheduling.stats import StepRecord
from forwardpass.engine.speculative.stats import step_acceptance
from forwardpass.engine.worker.encoder_step import check_encoder_input
from forwardpass.engine.worker.model_runner import ModelRunner
from forwardpass.engine.worker.routing_stats import RoutingRecord, RoutingStats
from forwardpass.errors import ContextLengthError, ForwardpassError, SamplingParamsError, ValidationError
from forwardpass.loader.generation_config import GenerationDefaults
from forwardpass.lora.manager import LoRAManager
from forwardpass.lora.request import LoRARequest
from forwardpass.models.model_spec import ModelSpec
from forwardpass.plan import PLAIN, ExecutionPlan
from forwardpass.sampling.params import SamplingParams


@dataclass(frozen=True)
class EngineCoreOutput:
    deltas: list[TokenDelta]
    record: StepRecord
    failed: dict[str, ForwardpassError] = field(default_factory=dict)  # requests this step failed alone


class EngineCore:
    def __init__(
        self,
        *,
        model_dir: Path,
        config: EngineConfig,
        model: torch.nn.Module,
        spec: ModelSpec,
        kv: KVCacheManager,
        scheduler: Scheduler,
        runner: ModelRunner,
        max_model_len: int,
        generation_defaults: GenerationDefaults,
        eos_token_ids: list[int],
        lora: LoRAManager | None = None,
        routing_stats: RoutingStats | None = None,
        cost: StepCost | None = None,
        plan: ExecutionPlan = PLAIN,
    ):
        self.model_dir, self.config, self.model, self.spec = model_dir, config, model, spec
        # how the model computes (forwardpass/plan.py): reported by /v1/models and explain --json
        self.plan = plan
        self.kv, self.scheduler, self.runner = kv, scheduler, runner
        self.max_model_len = max_model_len
        self.generation_defaults, self.eos_token_ids = generation_defaults, eos_token_ids
        self.lora_manager, self.routing_stats, self.cost = lora, routing_stats, cost
        self.stats: deque[StepRecord] = deque(maxlen=config.max_stats_records)
        self.step_counter = 0

    # ----- requests ------------------------------------------------------------------------------
    def default_sampling_params(self) -> SamplingParams:
        d = self.generation_defaults
        p = SamplingParams()
        return SamplingParams(
            temperature=p.temperature if d.temperature is None else d.temperature,
            top_p=p.top_p if d.top_p is None else d.top_p,
            top_k=p.top_k if d.top_k is None else d.top_k,
            min_p=p.min_p if d.min_p is None else d.min_p,
            repetition_penalty=p.repetition_penalty if d.repetition_penalty is None else d.repetition_penalty,
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        lora_request: LoRARequest | None = None,
        arrival_time: float | None = None,
        encoder_input: torch.Tensor | None = None,  # encoder–decoder models (Whisper): log-mel features
    ) -> None:
        """Validate and queue a request; raises a ``ForwardpassError`` naming the bad field."""
        check_encoder_input(self.spec, encoder_input)
        if request_id in self.scheduler.requests:
            raise ValidationError(f"request id {request_id!r} is already in use", param="request_id")
        if not isinstance(params, SamplingParams):
            raise ValidationError(
                f"params must be SamplingParams, got {type(params).__name__}", param="params"
            )
        if not prompt_token_ids:
            raise ValidationError("the prompt is empty", param="prompt")
        vocab = self.spec.vocab
        if any(type(t) is not int or t < 0 or t >= vocab for t in prompt_token_ids):
            raise ValidationError(f"prompt token ids must be integers in [0, {vocab})", param="prompt")
        if params.top_k > vocab:
            raise SamplingParamsError(
                f"top_k must be -1 (disabled) or in [1, {vocab}] (the vocabulary size), got {params.top_k}",
                param="top_k",
            )
        for name, ids in (("logit_bias", params.logit_bias or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ()),
                          ("logprob_token_ids", params.logprob_token_ids or ())):
            if bad := [t for t in ids if t >= vocab]:
                raise SamplingParamsError(f"{name}: token id {bad[0]} is not in [0, {vocab})", param=name)
        if params.structured_outputs is not None and self.runner.grammars is None:
            raise ValidationError("structured output needs the model's tokenizer.json",
                                  param="structured_outputs")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ContextLengthError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(prompt_token_ids)} tokens and at least one token must be generated",
                param="prompt",
            )
        if lora_request is not None:
            if self.lora_manager is None:
                raise ValidationError(
                    "this engine was not started with LoRA enabled (enable_lora=True)", param="lora"
                )
            self.lora_manager.add_adapter(lora_request)  # a bad adapter fails this request now
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        ids = list(prompt_token_ids)
        self.scheduler.add_request(
            [
                Sequence(request_id, ids, params, index=i, lora_request=lora_request, arrival_time=arrival,
                         encoder_input=encoder_input)
                for i in range(params.n)
            ]
        )

    def abort(self, request_ids: list[str]) -> None:
        """Stop requests now and return their KV blocks to the pool. Unknown ids are ignored."""
        self.scheduler.abort(request_ids)

    def stop_samples(self, samples: list[tuple[str, int]]) -> None:
        """Stop single samples of requests (a stop string ended them in the front end)."""
        self.scheduler.stop_samples(samples)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests)

    # ----- the step ------------------------------------------------------------------------------
    def step(self) -> EngineCoreOutput:
        """One forward pass over the scheduled batch; the token deltas it produced and its record."""
        start = time.monotonic()
        scheduled = self.scheduler.schedule()
        result = self.runner.execute(scheduled)
        deltas = self.scheduler.update(scheduled, result)
        failed: dict[str, ForwardpassError] = {}
        for seq_id, reason in result.failed:  # fail these requests alone; their blocks return now
            if (seq := self.scheduler.seqs.get(seq_id)) is not None:
                failed[seq.request_id] = ForwardpassError(reason)
        self.scheduler.abort(list(failed))
        self.step_counter += 1
        record = self._record(scheduled, result, start)
        self.stats.append(record)
        if self.routing_stats is not None and result.routing_counts is not None:
            self.routing_stats.append(
                RoutingRecord(
                    step=self.step_counter,
                    num_tokens=scheduled.total_num_tokens,
                    layers=list(self.spec.moe.layer_ids) if self.spec.moe else [],
                    tokens_per_expert=[list(c) for c in result.routing_counts],
                )
            )
        return EngineCoreOutput(deltas, record, failed)

    def _record(self, scheduled: SchedulerOutput, result: RunnerOutput, start: float) -> StepRecord:
        num_sampled = len(result.seq_ids)
        drafts, accepted, lengths, proposals = step_acceptance(scheduled.chunks, result.seq_ids)
        num_decode = sum(1 for c in scheduled.chunks if c.is_decode)
        # draft tokens verified are neither prompt work nor the decode token itself
        num_prefill = scheduled.total_num_tokens - num_decode - sum(len(c.draft_token_ids) for c in
                                                                     scheduled.chunks)
        s, kv = self.scheduler, self.kv
        flops = nbytes = 0.0
        if self.cost is not None:
            spans = [(c.num_computed_tokens, c.num_new_tokens) for c in scheduled.chunks]
            flops, nbytes = self.cost.step(spans, num_sampled)
        return StepRecord(
            step=self.step_counter,
            start_time=start,
            duration_s=time.monotonic() - start,
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_seqs_scheduled=len(scheduled.chunks),
            num_prefill_tokens=num_prefill,
            num_decode_tokens=num_decode,
            num_sampled=num_sampled,
            kv_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits,
            num_preemptions=scheduled.num_preempted,
            total_preemptions=s.num_preemptions,
            flops=flops,
            bytes=nbytes,
            num_draft_tokens=drafts,
            num_accepted_tokens=accepted,
            acceptance_lengths=lengths, draft_token_ids=proposals,
        )

    # ----- LoRA (vLLM's engine methods) ----------------------------------------------------------
    def _lora(self) -> LoRAManager:
        if self.lora_manager is None:
            raise ValidationError(
                "this engine was not started with LoRA enabled (enable_lora=True)", param="lora"
            )
        return self.lora_manager

    def add_lora(self, lora_request: LoRARequest) -> bool:
        self._lora().add_adapter(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        return self._lora().remove_adapter(lora_id)

    def list_loras(self) -> set[int]:
        return {r.lora_int_id for r in self._lora().list_adapters()}

    # ----- invariants ----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        live = self.scheduler.live_sequences()
        self.kv.check_invariants(live)
        for seq in self.scheduler.waiting:
            assert seq.status is SequenceStatus.WAITING and not any(self.kv.block_tables(seq)), (
                "a waiting sequence holds blocks"
            )
        if not self.has_unfinished_requests():
            assert not live, "no request is unfinished but sequences are still scheduled"
            assert self.kv.num_free_blocks == self.kv.num_blocks, (
                "all requests are done but blocks are still owned"
            )
