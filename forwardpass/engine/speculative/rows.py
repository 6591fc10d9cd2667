"""The most rows a step may have and still run every row as a one-row decode step does.

A verify step's rows are decode rows (the runner gives each position a decode query), so they take the decode
kernels as long as the step stays small: the decode stack up to its ``max_rows``; a quantized weight's
small-batch kernel below its ``gemm_rows`` (from there on a GEMM that rounds otherwise: dequantize + bf16 or
AMX); fp32 weights the small-batch matmul up to ``MAX_ROWS``. Within all of them each row is computed alone,
so a verified token and its logprob are bitwise those of plain decoding; the policy keeps steps within this.
The LM head counts too: on SmolLM2 Q4_1 its Q8_0 matrix leaves its kernel at 16 rows, the K-block
projections at 32.
"""

from __future__ import annotations

from torch import nn


def decode_row_limit(model: nn.Module) -> int:
    """Rows a decode step of ``model`` may have on the one-row numerics (see the module docstring)."""
    from forwardpass.layers.small_matmul import MAX_ROWS

    limits = [MAX_ROWS]
    stack = getattr(getattr(model, "model", None), "decode_stack", None)
    if stack is not None:
        limits.append(stack.max_rows)
    for module in model.modules():  # projections, the LM head, a tied embedding used as the head
        gemm_rows = getattr(getattr(module, "weight", None), "gemm_rows", None)
        if isinstance(gemm_rows, int):
            limits.append(gemm_rows - 1)
    return min(limits)
