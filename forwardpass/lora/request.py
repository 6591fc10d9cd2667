"""``LoRARequest``: which adapter a request runs with (mirrors ``vllm.lora.request.LoRARequest``)."""

from __future__ import annotations

from dataclasses import dataclass

from forwardpass.errors import ValidationError


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str  # the adapter's public name (a model name on the server)
    lora_int_id: int  # unique positive id; also keys the prefix cache, so reuse ids only for the same adapter
    lora_path: str = ""  # a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)

    def __post_init__(self) -> None:
        if (not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool)
                or self.lora_int_id < 1):
            raise ValidationError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}",
                                  param="lora_request")
        if not self.lora_name:
            raise ValidationError("lora_name must not be empty", param="lora_request")
        if not self.lora_path:
            raise ValidationError(f"LoRA adapter {self.lora_name!r} has no lora_path", param="lora_request")
        object.__setattr__(self, "lora_path", str(self.lora_path))

    # vLLM spellings
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
