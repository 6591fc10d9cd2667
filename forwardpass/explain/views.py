"""Per-layer views of one request, computed by calling the model's own modules on its tokens.

Nothing here runs inside the engine: the decoder's layers are called one by one, exactly as
``DecoderModel.forward`` does (with ``ctx=None``: one causal sequence, nothing cached), so the hidden
state after each layer can be measured, one head's attention probabilities recomputed as the reference
attention does (``attention/naive.py``: S = q·kᵀ·scale, the shared causal mask, softmax), and, for MoE
layers, the router's choice per token (``layers/moe.route``). The final hidden states give the logits
each drawn token was sampled from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from forwardpass.attention.mask import build_mask
from forwardpass.layers.moe import FusedMoE, route
from forwardpass.layers.rotary import apply_rotary


@dataclass
class LayerViews:
    norms: list[list[float]]  # [embedding + each layer][token]: L2 norm of the hidden state
    attention: list[list[float]]  # [query][key] probabilities of one head (0 where masked)
    attention_layer: int
    attention_head: int
    routing: list[dict]  # MoE layers: per token the chosen experts and their weights
    logits: torch.Tensor  # [rows, vocab] of the requested rows
    final_hidden: torch.Tensor  # [T, hidden] after the final norm (what model.forward returns)


def head_probabilities(attn: torch.nn.Module, x: torch.Tensor, cos, sin, head: int) -> torch.Tensor:
    """Attention probabilities ``[T, T]`` of query head ``head`` of a ``DecoderAttention`` on input ``x``."""
    t = x.shape[0]
    q, k, _ = attn.qkv_proj.split(attn.qkv_proj(x))
    q = q.view(t, attn.num_heads, attn.head_dim)
    k = k.view(t, attn.num_kv_heads, attn.head_dim)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    kv_head = head // (attn.num_heads // attn.num_kv_heads)  # grouped-query: the KV head it reads
    s = (q[:, head].float() @ k[:, kv_head].float().T) * attn.attn.scale
    mask = build_mask(t, t, causal=True, sliding_window=attn.attn.sliding_window)
    if mask is not None:
        s = s.masked_fill(~mask[0, 0], float("-inf"))
    return torch.softmax(s, dim=-1)


def _standard(model: torch.nn.Module) -> bool:
    """A Llama-family decoder whose layers compute exactly ``DecoderLayer.forward`` (views can follow it)."""
    from forwardpass.models.llama import DecoderAttention, DecoderLayer

    layers = getattr(getattr(model, "model", None), "layers", None)
    return layers is not None and all(
        type(lyr).forward is DecoderLayer.forward and type(lyr.self_attn) is DecoderAttention
        for lyr in layers
    )


@torch.inference_mode()
def layer_views(
    model: torch.nn.Module, token_ids: list[int], logit_rows: list[int], *, layer: int | None = None,
    head: int = 0
) -> LayerViews:
    """Run the Llama-family ``model`` layer by layer over ``token_ids``; logits of ``logit_rows``.

    A model whose layers compute something else (Gemma's extra norms, multi-latent attention) gets only
    what its own forward gives: the logits and final hidden states, no per-layer views."""
    device = next(model.parameters()).device
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    positions = torch.arange(len(token_ids), device=device)
    rows = torch.tensor(logit_rows, dtype=torch.long, device=device)
    if not _standard(model):
        final = model(ids, positions, None)
        logits = model.compute_logits(final[rows])
        return LayerViews([], [], -1, -1, [], logits.float().cpu(), final)
    dm = model.model
    x = dm.embed_tokens(ids)
    cos, sin = dm.rotary.cos_sin(positions, x.dtype)
    n_layers = len(dm.layers)
    layer = n_layers - 1 if layer is None else layer
    if not 0 <= layer < n_layers:
        raise ValueError(f"layer must be in [0, {n_layers}), got {layer}")
    norms = [x.float().norm(dim=-1).tolist()]
    probs = None
    routing = []
    for i, lyr in enumerate(dm.layers):
        h_in = lyr.input_layernorm(x)
        if i == layer:
            if not 0 <= head < lyr.self_attn.num_heads:
                raise ValueError(f"head must be in [0, {lyr.self_attn.num_heads}), got {head}")
            probs = head_probabilities(lyr.self_attn, h_in, cos, sin, head)
        h = x + lyr.self_attn(h_in, cos, sin, None)
        m_in = lyr.post_attention_layernorm(h)
        if isinstance(lyr.mlp, FusedMoE):
            w, e = route(lyr.mlp.gate(m_in), lyr.mlp.top_k, lyr.mlp.renormalize)
            routing.append({"layer": i, "experts": e.tolist(), "weights": w.tolist(),
                            "num_experts": lyr.mlp.num_experts})
        x = h + lyr.mlp(m_in)
        norms.append(x.float().norm(dim=-1).tolist())
    final = dm.norm(x)
    logits = model.compute_logits(final[rows])
    assert probs is not None
    return LayerViews(norms, probs.tolist(), layer, head, routing, logits.float().cpu(), final)
