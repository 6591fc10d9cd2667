"""``LoRALLMEngine``: the LLM engine with LoRA adapters (``LLM(model, enable_lora=True, ...)``).

Differences from :class:`LLMEngine`, all through hooks the base engine exposes:

* ``validate_lora`` loads and validates a request's adapter when the request is added, so a bad
  adapter fails that request at once (never a later step);
* ``runner.before_forward_hook`` maps each row of the flattened batch to its adapter
  (:meth:`LoRAManager.prepare_batch`); ``runner.last_forward_hook`` clears the mapping afterwards;
* ``scheduler.admit_filter`` admits a sequence only while at most ``max_loras`` distinct adapters run
  (the ones waiting keep their place in the queue);
* the prefix cache already keys blocks by ``Sequence.lora_id``, so the same prompt under two adapters
  never shares K/V.
"""

from __future__ import annotations

from pathlib import Path

from forwardpass.config import EngineConfig
from forwardpass.engine.llm_engine import LLMEngine
from forwardpass.lora.manager import LoRAManager


class LoRALLMEngine(LLMEngine):
    def __init__(self, model: str | Path, config: EngineConfig | None = None, *, enable_lora: bool = True,
                 max_loras: int = 1, max_lora_rank: int = 16, max_cpu_loras: int | None = None, **kwargs):
        super().__init__(model, config, **kwargs)
        self.lora_manager = LoRAManager(self.model, self.model_config, max_loras=max_loras,
                                        max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras,
                                        dtype=self.config.torch_dtype, device=self.config.device)
        self.runner.before_forward_hook = self.lora_manager.prepare_batch
        previous = self.runner.last_forward_hook

        def after_forward(ctx) -> None:
            self.lora_manager.clear_batch()  # a direct model call later must not see this step's mapping
            if previous is not None:
                previous(ctx)

        self.runner.last_forward_hook = after_forward
        self.scheduler.admit_filter = self.lora_manager.can_admit

    def validate_lora(self, lora_request) -> None:
        if lora_request is not None:
            self.lora_manager.add_adapter(lora_request)

    # vLLM's engine methods
    def add_lora(self, lora_request) -> bool:
        self.lora_manager.add_adapter(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        return self.lora_manager.remove_adapter(lora_id)

    def list_loras(self) -> set[int]:
        return {r.lora_int_id for r in self.lora_manager.list_adapters()}
