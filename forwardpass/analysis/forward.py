"""Every operation of one forward pass of a decoder, from its ``ModelSpec``: what ``roofline.analyze``
evaluates against a device (the accounting assumptions are listed in ``roofline.py``). Parameter counts, cache
bytes and attention pairs are ``models/accounting.py``'s, as the engine's cost model counts them; where a
family's layers differ from attention + MLP, its family gives their ops (``models/family.py``)."""

from __future__ import annotations

from forwardpass.models.family import family_of
from forwardpass.models.model_spec import ModelSpec
from forwardpass.op_cost import MATMUL, OpCost, elementwise, linear

NORM_FLOPS = 4.0  # per element: square, accumulate, scale by rsqrt, scale by weight
SOFTMAX_FLOPS = 5.0  # per score: max, subtract, exp, accumulate, divide
ACT_FLOPS = 5.0  # per element of SiLU(gate) * up: negate, exp, add, divide, multiply
LOGIT_BYTES = 4.0  # logits are written in fp32


def forward_ops(
    shape: ModelSpec,
    stage: str,
    *,
    batch: int,
    new_tokens: int,
    kv_len: int,
    pairs_per_seq: float,
    wb: float,
    ab: float,
    kvb: float,
    attention: str = "fused",
) -> list[OpCost]:
    """Every operation of one forward pass over ``batch`` sequences of ``new_tokens`` new tokens each.

    ``kv_len`` positions of K and V are read per sequence and ``pairs_per_seq`` (query, key) pairs
    scored. Each returned op is already summed over the layers it occurs in (``count``).
    """
    H, nh, nkv, hd = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim
    qd, kvd = shape.q_dim, shape.kv_dim
    T = batch * new_tokens
    L = shape.layers
    naive = attention == "naive"

    layer: list[OpCost] = []
    layer.append(
        elementwise(stage, "input_norm", T * H, flops_per_element=NORM_FLOPS, ab=ab, weight_bytes=H * wb)
    )
    layer.append(linear(stage, "q_proj", T, H, qd, wb=wb, ab=ab))
    layer.append(linear(stage, "k_proj", T, H, kvd, wb=wb, ab=ab, out_kv_bytes=kvb))
    layer.append(linear(stage, "v_proj", T, H, kvd, wb=wb, ab=ab, out_kv_bytes=kvb))
    if shape.norm.qk:
        layer.append(
            elementwise(
                stage,
                "qk_norm",
                T * (qd + kvd),
                flops_per_element=NORM_FLOPS,
                ab=ab,
                weight_bytes=2 * hd * wb,
            )
        )

    # attention: QK^T, softmax, PV
    if naive:
        pairs = batch * new_tokens * kv_len  # the full matrix is computed, then masked
        kv_reads = nh  # K and V re-read per query head (repeat_kv)
        s_bytes = batch * nh * new_tokens * kv_len * ab  # one materialised S (or P)
    else:
        pairs = batch * pairs_per_seq
        kv_reads = nkv
        s_bytes = 0.0
    k_read = batch * kv_len * kv_reads * hd * kvb
    scores = OpCost(stage, "attn_scores", MATMUL, 2.0 * nh * hd * pairs, 0.0, T * qd * ab + s_bytes, k_read)
    softmax = elementwise(
        stage, "softmax", nh * pairs, flops_per_element=SOFTMAX_FLOPS, ab=ab, reads=0, writes=0
    )
    softmax.act_bytes = 2 * s_bytes  # read S, write P (naive only)
    values = OpCost(stage, "attn_values", MATMUL, 2.0 * nh * hd * pairs, 0.0, T * qd * ab + s_bytes, k_read)
    layer += [scores, softmax, values]

    layer.append(linear(stage, "o_proj", T, qd, H, wb=wb, ab=ab))
    family = family_of(shape)
    own = family.attention_ops(shape, stage, tokens=T, batch=batch, kv_len=kv_len,
                               pairs=batch * pairs_per_seq, wb=wb, ab=ab, kvb=kvb)
    if own is not None:  # the family's own attention (multi-latent: absorbed attention over the latent)
        layer = layer[:1] + own
    layer.append(
        elementwise(
            stage, "post_attention_norm", T * H, flops_per_element=NORM_FLOPS, ab=ab, weight_bytes=H * wb
        )
    )
    La = shape.attention_layers  # the others are the family's state layers (Mamba2, Gated DeltaNet) or MLPs
    ops = [op.times(La, count=La) for op in layer] if La else []
    if La < L:
        ops += family.mixer_ops(shape, stage, tokens=T, batch=batch, wb=wb, ab=ab)
    # a family whose layers are neither (DeepSeek-V4: window + compressed attention, hyper-connections)
    whole = family.layer_ops(shape, stage, batch=batch, new_tokens=new_tokens, context=kv_len, wb=wb, ab=ab,
                             kvb=kvb)
    if whole is not None:
        ops = whole

    # feed-forward: dense layers
    gated = family_of(shape).mlp_gated
    if shape.dense_layers:
        I = shape.intermediate
        mlp = [
            *([linear(stage, "gate_proj", T, H, I, wb=wb, ab=ab)] if gated else []),
            linear(stage, "up_proj", T, H, I, wb=wb, ab=ab),
            elementwise(stage, "act", T * I, flops_per_element=ACT_FLOPS, ab=ab, reads=2, writes=1),
            linear(stage, "down_proj", T, I, H, wb=wb, ab=ab),
        ]
        ops += [op.times(shape.dense_layers, count=shape.dense_layers) for op in mlp]

    # feed-forward: MoE layers — router, then only the active experts
    if shape.moe and shape.moe.layer_ids:
        E, k, Im = shape.moe.num_experts, shape.moe.experts_per_tok, shape.moe.expert_intermediate
        Is = shape.moe.shared_expert_intermediate
        touched = shape.unique_experts(T)
        Tk = T * k  # token-expert assignments
        router_out = E + (1 if Is else 0)
        moe = [
            linear(stage, "router", T, H, router_out, wb=wb, ab=ab, out_bytes=LOGIT_BYTES),
            *([linear(stage, "experts.gate_proj", Tk, H, Im, wb=wb, ab=ab, weight_params=touched * H * Im)]
              if gated else []),
            linear(stage, "experts.up_proj", Tk, H, Im, wb=wb, ab=ab, weight_params=touched * H * Im),
            elementwise(stage, "experts.act", Tk * Im, flops_per_element=ACT_FLOPS, ab=ab, reads=2, writes=1),
            linear(stage, "experts.down_proj", Tk, Im, H, wb=wb, ab=ab, weight_params=touched * H * Im),
        ]
        if Is:
            moe += [
                *([linear(stage, "shared_expert.gate_proj", T, H, Is, wb=wb, ab=ab)]
                  if gated else []),
                linear(stage, "shared_expert.up_proj", T, H, Is, wb=wb, ab=ab),
                elementwise(stage, "shared_expert.act", T * Is, flops_per_element=ACT_FLOPS, ab=ab, reads=2),
                linear(stage, "shared_expert.down_proj", T, Is, H, wb=wb, ab=ab),
            ]
        ops += [op.times(shape.moe_layers, count=shape.moe_layers) for op in moe]

    # once per pass: embedding gather (first), final norm and LM head (last position of each sequence)
    embed = OpCost(stage, "embed", "vector", 0.0, min(T, shape.vocab) * H * wb, T * H * ab)
    ops.insert(0, embed)
    ops.append(
        elementwise(stage, "final_norm", batch * H, flops_per_element=NORM_FLOPS, ab=ab, weight_bytes=H * wb)
    )
    ops.append(linear(stage, "lm_head", batch, H, shape.vocab, wb=wb, ab=ab, out_bytes=LOGIT_BYTES))
    for op in ops:
        op.batch = batch
    return ops
