"""Quantizing at load: which weights an ``int8`` / ``int4`` plan turns into blocks, and in which format.

The execution plan (``forwardpass/plan.py``) carries the formats; each layer's weight method quantizes its own
weight once after loading (``layers/weight_methods.py``), one tensor at a time (so the peak memory is the fp32
model plus one quantized matrix):

* every ``Linear`` weight (attention, MLP, a LoRA adapter's *base* projection: the adapter slot adds its
  low-rank update to the base output whatever computed it) → ``q8_0`` for int8, ``q4_0`` for int4;
* MoE expert stacks (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) → the same format;
* the LM head (or, when tied, the embedding matrix it shares) → ``q8_0`` in both modes. It is a large
  matrix (a quarter of Qwen3-0.6B), so quantizing it pays at decode; 4 bits there cost more quality than
  elsewhere (measured, see README), so int4 keeps it at 8 bits, as llama.cpp's Q4_0 files usually do.
  The tied embedding's lookup dequantizes just the rows it reads; an untied embedding stays fp32
  (a lookup reads a few rows per token, so it costs memory, not time).

Left in fp32, on purpose (the ``"dense"`` role): MoE router gates (tiny, and a flipped expert choice changes
the output far more than rounding does), DeepSeek's ``kv_b_proj`` (MLA reads it as a matrix to absorb, not
through a matmul) and DeepSeek-V4's grouped ``wo_a``; also norms, convolutions and biases.
"""

from __future__ import annotations

from forwardpass.errors import ConfigError
from forwardpass.quant import QUANTIZATIONS

HEAD_FORMAT = "q8_0"


def check_quantization(value: str | None) -> str | None:
    if value is None or value in QUANTIZATIONS:
        return value
    raise ConfigError(
        f"unknown quantization {value!r}; use {' or '.join(QUANTIZATIONS)} (or none)", param="quantization"
    )
