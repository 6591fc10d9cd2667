"""The per-layer attention ops of multi-latent attention (DeepSeek-V2/V3) for the roofline table: the
roofline term of its family (``deepseek_spec.py::MLAFamily.attention_ops``).

Costed in the absorbed form the engine decodes with (``attention/mla.py``): the KV cache holds one
latent of ``kv_lora_rank + qk_rope_head_dim`` values per token and layer, written by
``kv_a_proj_with_mqa``; attention reads it once per sequence (every query head shares it), the query
is first multiplied by ``W_UK`` (``q_absorb``) and each head's output by ``W_UV`` (``v_up``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from forwardpass.op_cost import MATMUL, OpCost, elementwise, linear

if TYPE_CHECKING:
    from forwardpass.models.model_spec import ModelSpec

SOFTMAX_FLOPS = 5.0


def mla_attention_ops(
    shape: ModelSpec, stage: str, *, tokens: int, batch: int, kv_len: int, pairs: float, wb: float, ab: float,
    kvb: float,
) -> list[OpCost]:
    """q projection(s), latent projection (the cache write), absorbed attention and o_proj of one layer."""
    H, nh, T = shape.hidden, shape.heads, tokens
    mla = shape.mla
    assert mla is not None
    R, rope, nope, vd = mla.kv_lora_rank, mla.qk_rope_head_dim, mla.qk_nope_head_dim, mla.v_head_dim
    dl, qk = R + rope, nope + rope
    ops = []
    if mla.q_lora_rank:
        ops.append(linear(stage, "q_a_proj", T, H, mla.q_lora_rank, wb=wb, ab=ab))
        ops.append(linear(stage, "q_b_proj", T, mla.q_lora_rank, nh * qk, wb=wb, ab=ab))
    else:
        ops.append(linear(stage, "q_proj", T, H, nh * qk, wb=wb, ab=ab))
    ops.append(linear(stage, "kv_a_proj (latent)", T, H, dl, wb=wb, ab=ab, out_kv_bytes=kvb))
    ops.append(OpCost(stage, "q_absorb", MATMUL, 2.0 * T * nh * nope * R, nh * nope * R * wb,
                      T * nh * (nope + R) * ab))
    latent_read = batch * kv_len * dl * kvb  # one shared latent per token, read once
    ops.append(OpCost(stage, "attn_scores", MATMUL, 2.0 * nh * dl * pairs, 0.0, T * nh * dl * ab,
                      latent_read))
    ops.append(elementwise(stage, "softmax", nh * pairs, flops_per_element=SOFTMAX_FLOPS, ab=ab, reads=0,
                           writes=0))
    ops.append(OpCost(stage, "attn_values", MATMUL, 2.0 * nh * R * pairs, 0.0, T * nh * R * ab))
    ops.append(OpCost(stage, "v_up", MATMUL, 2.0 * T * nh * R * vd, nh * R * vd * wb, T * nh * (R + vd) * ab))
    ops.append(linear(stage, "o_proj", T, nh * vd, H, wb=wb, ab=ab))
    return ops
