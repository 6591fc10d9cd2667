"""LLMEngine: add requests, call ``step()`` until done. The offline API (``LLM``) builds on this loop.

It is the synchronous front end of an :class:`EngineCore`: prompts are tokenized here, the core
computes one step and returns token deltas, and the :class:`OutputProcessor` turns them into text and
``RequestOutput``s. A sample that a stop string ends is stopped in the core before the next step.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

import torch

from forwardpass.config import EngineConfig
from forwardpass.engine.core import EngineCore
from forwardpass.engine.frontend.launch import build_engine_core
from forwardpass.engine.frontend.multimodal import encoder_input_for
from forwardpass.engine.frontend.output_processor import OutputProcessor
from forwardpass.engine.frontend.outputs import RequestOutput
from forwardpass.engine.scheduling.kv_cache import KVCacheManager
from forwardpass.engine.scheduling.scheduler import Scheduler
from forwardpass.engine.scheduling.stats import StepRecord
from forwardpass.engine.worker.routing_stats import RoutingStats
from forwardpass.errors import ValidationError
from forwardpass.loader.tokenizer import Tokenizer
from forwardpass.lora.manager import LoRAManager
from forwardpass.lora.request import LoRARequest
from forwardpass.models.model_spec import ModelSpec
from forwardpass.sampling.params import SamplingParams


class LLMEngine:
    def __init__(
        self, model: str | Path, config: EngineConfig | None = None, *, core: EngineCore | None = None
    ):
        self.model_dir = Path(model)
        self.core = core or build_engine_core(self.model_dir, config)
        self.config = self.core.config
        self.tokenizer: Tokenizer | None = (
            Tokenizer.from_dir(self.model_dir) if (self.model_dir / "tokenizer.json").exists() else None
        )
        self.output_processor = OutputProcessor(self.tokenizer)

    # ----- what the core knows (read-only views) ---------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        return self.core.model

    @property
    def spec(self) -> ModelSpec:
        return self.core.spec

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def eos_token_ids(self) -> list[int]:
        return self.core.eos_token_ids

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def kv(self) -> KVCacheManager:
        return self.core.kv

    @property
    def stats(self) -> deque[StepRecord]:
        return self.core.stats

    @property
    def routing_stats(self) -> RoutingStats | None:
        return self.core.routing_stats

    @property
    def lora_manager(self) -> LoRAManager | None:
        return self.core.lora_manager

    def default_sampling_params(self) -> SamplingParams:
        return self.core.default_sampling_params()

    # ----- requests ------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValidationError(
                    f"{self.model_dir} has no tokenizer.json: pass prompt token ids instead of text"
                )
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        lora_request: LoRARequest | None = None,
        arrival_time: float | None = None,
        multi_modal_data: dict | None = None,
    ) -> None:
        """``multi_modal_data={"audio": (samples, sample_rate)}`` for speech models (Whisper)."""
        params = params or self.default_sampling_params()
        token_ids = self.encode_prompt(prompt)
        self.core.add_request(
            request_id, token_ids, params, lora_request=lora_request, arrival_time=arrival_time,
            encoder_input=encoder_input_for(self.spec, multi_modal_data),
        )
        self.output_processor.add_request(
            request_id, prompt if isinstance(prompt, str) else None, token_ids, params, arrival_time
        )

    def abort(self, request_id: str | list[str]) -> None:
        """Stop a request now and return its KV blocks to the pool. Unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.core.abort(ids)
        self.output_processor.abort(ids)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.core.get_num_unfinished_requests()

    # ----- the step ------------------------------------------------------------------------------
    def step(self, only_finished: bool = False) -> list[RequestOutput]:
        """One forward pass. Returns the cumulative outputs of requests that advanced (``only_finished``
        skips building outputs nobody reads, as ``LLM.generate`` does)."""
        out = self.core.step()
        touched, stopped = self.output_processor.process(out.deltas)
        if stopped:
            self.core.stop_samples(stopped)
        if out.failed:  # those requests are gone (blocks freed); the others go on at the next step
            self.output_processor.abort(list(out.failed))
            rid, err = next(iter(out.failed.items()))
            raise type(err)(f"request {rid!r} failed: {err.message}", param=err.param, code=err.code)
        return [state.make_output() for state in touched if state.finished or not only_finished]

    # ----- LoRA ----------------------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.core.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.core.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.core.list_loras()

    def check_invariants(self) -> None:
        self.core.check_invariants()
