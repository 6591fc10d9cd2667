"""Multi-latent attention (DeepSeek-V2/V3) over a paged cache that holds only the latent.

Per token, MLA projects the hidden state down to a latent ``c`` of ``kv_lora_rank`` values (RMS-normed)
and one shared rotary key ``k_pe`` of ``qk_rope_head_dim`` values. Every head's key and value are
linear in ``c``: ``k_nope_h = W_UK[h] · c``, ``v_h = W_UV[h] · c`` (``kv_b_proj`` stacks ``W_UK`` and
``W_UV`` per head), and ``k_h = [k_nope_h, k_pe]``. So the cache stores ``[c, k_pe]`` —
``kv_lora_rank + qk_rope_head_dim`` values per token and layer, against ``2 · heads · head_dim`` for
ordinary attention — in a ``[num_blocks, block_size, latent_dim]`` tensor (``MLASpec``).

Two ways to attend, equal up to rounding (``tests/test_mla.py``):

* **expanded** (prefill, many queries): gather the context's latents, expand them with ``kv_b_proj``
  into per-head K and V, and run ordinary attention (``k`` width ``nope + rope``, ``v`` width
  ``v_head_dim``);
* **absorbed** (decode, one query per sequence): ``q_nope_h · k_nope_h = (W_UK[h]ᵀ · q_nope_h) · c``,
  so fold ``W_UK`` into the query once, attend with *one* shared KV "head" whose key is ``[c, k_pe]``
  and whose value is ``c`` (multi-query attention of width ``latent_dim``), then apply ``W_UV[h]`` to
  each head's output. Nothing per-head is ever built for the cached tokens: decode reads
  ``latent_dim`` values per token instead of ``2 · heads · head_dim``.
"""

from __future__ import annotations

import torch

from forwardpass.attention import attention
from forwardpass.attention.context import AttentionContext


def write_latent(cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``[T, latent_dim]`` at flat slots ``[T]`` of a ``[num_blocks, block_size, latent_dim]`` cache."""
    cache.view(-1, cache.shape[-1]).index_copy_(0, slot_mapping, latent)


def gather_latent(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` latents of each sequence: ``[B, length, latent_dim]``
    (``[max_blocks]`` → B = 1)."""
    tables = block_tables.view(-1, block_tables.shape[-1])
    b, bs = tables.shape[0], cache.shape[1]
    nblocks = -(-length // bs)
    return cache.index_select(0, tables[:, :nblocks].reshape(-1)).view(b, nblocks * bs, -1)[:, :length]


def split_kv_b(kv_b_weight: torch.Tensor, heads: int, nope: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_b_proj.weight [H·(nope + v), R]`` → ``W_UK [H, nope, R]``, ``W_UV [H, v, R]``."""
    w = kv_b_weight.view(heads, -1, kv_b_weight.shape[-1])
    return w[:, :nope], w[:, nope:]


def expanded_attention(
    q: torch.Tensor, latent: torch.Tensor, kv_b_weight: torch.Tensor, *, rank: int, nope: int, scale: float,
    causal: bool = True, key_padding_mask: torch.Tensor | None = None, backend: str = "sdpa",
) -> torch.Tensor:
    """q ``[B, H, Nq, nope + rope]``, latent ``[B, Nk, rank + rope]`` → ``[B, H, Nq, v]``: per-head K/V built
    from the latents, then ordinary attention (queries aligned to the end of the keys)."""
    b, heads, _, _ = q.shape
    w_uk, w_uv = split_kv_b(kv_b_weight, heads, nope)
    c, k_pe = latent[..., :rank], latent[..., rank:]
    k_nope = torch.einsum("bkr,hnr->bhkn", c, w_uk)
    v = torch.einsum("bkr,hvr->bhkv", c, w_uv)
    k = torch.cat([k_nope, k_pe[:, None].expand(b, heads, -1, -1)], dim=-1)
    return attention(q, k, v, causal=causal, scale=scale, key_padding_mask=key_padding_mask, backend=backend)


def absorbed_attention(
    q: torch.Tensor, latent: torch.Tensor, kv_b_weight: torch.Tensor, *, rank: int, nope: int, scale: float,
    key_padding_mask: torch.Tensor | None = None, backend: str = "sdpa",
) -> torch.Tensor:
    """One query per sequence, attending to all its keys: q ``[B, H, nope + rope]``, latent
    ``[B, Nk, rank + rope]`` → ``[B, H, v]`` without expanding any cached token."""
    heads = q.shape[1]
    w_uk, w_uv = split_kv_b(kv_b_weight, heads, nope)
    q_latent = torch.einsum("bhn,hnr->bhr", q[..., :nope], w_uk)  # W_UK folded into the query
    q_abs = torch.cat([q_latent, q[..., nope:]], dim=-1)  # [B, H, rank + rope]
    kv = latent[:, None]  # one KV head shared by every query head (MQA)
    out = attention(q_abs[:, :, None], kv, kv[..., :rank], causal=False, scale=scale,
                    key_padding_mask=key_padding_mask, backend=backend)[:, :, 0]  # [B, H, rank]
    return torch.einsum("bhr,hvr->bhv", out, w_uv)  # W_UV after attention


def latent_attention(
    q: torch.Tensor, latent: torch.Tensor, kv_b_weight: torch.Tensor, ctx: AttentionContext | None,
    layer_idx: int, *, rank: int, nope: int, scale: float,
) -> torch.Tensor:
    """The MLA step of one layer over the engine's flattened batch: q ``[T, H, nope + rope]``, this step's
    latents ``[T, rank + rope]`` → ``[T, H, v]``. Writes the latents into the layer's cache first."""
    kw = {"rank": rank, "nope": nope, "scale": scale}
    if ctx is None:  # one causal sequence, nothing cached
        return expanded_attention(q.transpose(0, 1)[None], latent[None], kv_b_weight, **kw)[0].transpose(0, 1)
    cache = ctx.kv_caches[layer_idx]
    meta = ctx.for_layer(layer_idx)
    write_latent(cache, latent, meta.slot_mapping)
    nd, backend = ctx.num_decode, ctx.backend
    parts = []
    if nd:
        assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
        ctx_latent = gather_latent(cache, meta.decode_block_tables, meta.decode_max_len)
        pos = torch.arange(meta.decode_max_len, device=q.device)[None, :]
        mask = pos < meta.decode_seq_lens[:, None]
        parts.append(absorbed_attention(q[:nd], ctx_latent, kv_b_weight, key_padding_mask=mask,
                                        backend=backend, **kw))
    for span in meta.prefills:
        rows = slice(span.q_start, span.q_start + span.q_len)
        lat = latent[rows] if span.context_len == span.q_len else gather_latent(
            cache, span.block_table, span.context_len)[0]
        parts.append(expanded_attention(q[rows].transpose(0, 1)[None], lat[None], kv_b_weight,
                                        backend=backend, **kw)[0].transpose(0, 1))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
