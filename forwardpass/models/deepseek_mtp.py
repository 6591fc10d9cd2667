"""DeepSeek-V3's multi-token-prediction (MTP) layer: the checkpoint's extra decoder layer that predicts the
token after next, used as a draft by ``speculative_config={"method": "mtp"}``
(``engine/speculative/mtp.py``).

A checkpoint with ``num_nextn_predict_layers >= 1`` stores it as decoder layer ``num_hidden_layers`` (the
model's own layers are ``0 .. num_hidden_layers - 1``, and the main model never reads it):

* ``model.layers.N.enorm`` / ``.hnorm``: RMSNorms of the next token's embedding and of the main model's
  hidden state at the current position;
* ``model.layers.N.eh_proj``: ``Linear(2H -> H)`` over ``concat(enorm(embed(t_{i+1})), hnorm(h_i))``,
  the embedding first (vLLM's ``deepseek_mtp.py``, SGLang's ``deepseek_nextn.py``);
* a whole decoder layer under the same prefix (``self_attn``, ``mlp`` (MoE in V3), the two layernorms), with
  its own KV cache;
* ``model.layers.N.shared_head.norm`` then ``.shared_head.head`` for the logits. V3 checkpoints also store
  ``shared_head.head`` and ``embed_tokens`` under the prefix, as copies of the main model's: a copy equal to
  the main model's tensor is not loaded again (the main model's is used), a different one is.

``h_i`` is the main model's output at position ``i`` (after its final norm, as vLLM and SGLang feed it); the
output at ``i`` predicts ``t_{i+2}``. For further drafts the layer runs again on its own output (before
``shared_head.norm``) and the draft it just made, one position on.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import nn

from forwardpass.layers.embedding import TokenEmbedding
from forwardpass.layers.linear import Linear
from forwardpass.layers.norm import RMSNorm
from forwardpass.loader.weights import WeightSource
from forwardpass.models.deepseek import DeepseekDecoderLayer, DeepseekV2ForCausalLM
from forwardpass.models.model_spec import ModelSpec
from forwardpass.models.moe_loading import load_moe_weights


def mtp_prefix(spec: ModelSpec) -> str:
    """The checkpoint prefix of the (first) MTP layer: ``model.layers.{num_hidden_layers}``."""
    return f"model.layers.{spec.layers}"


class SharedHead(nn.Module):
    def __init__(self, spec: ModelSpec, own_head: bool):
        super().__init__()
        self.norm = RMSNorm(spec.hidden, spec.norm.eps)
        self.head = Linear(spec.hidden, spec.vocab, role="lm_head") if own_head else None


class DeepseekMTPLayer(DeepseekDecoderLayer):
    """One MTP layer: the decoder layer (its attention caches under ``layer_idx``) behind the two norms and
    ``eh_proj``. ``own_head`` / ``own_embed``: the checkpoint has its own head / embedding for it."""

    def __init__(self, spec: ModelSpec, layer_idx: int, *, own_head: bool = False, own_embed: bool = False):
        moe = spec.moe
        if moe and moe.layer_ids:  # vLLM: MoE from first_k_dense_replace on; the MTP layer is past them all
            moe = dataclasses.replace(moe, layer_ids=(*moe.layer_ids, layer_idx))
            spec = dataclasses.replace(spec, moe=moe)
        super().__init__(spec, layer_idx)
        self.enorm = RMSNorm(spec.hidden, spec.norm.eps)
        self.hnorm = RMSNorm(spec.hidden, spec.norm.eps)
        self.eh_proj = Linear(2 * spec.hidden, spec.hidden)
        self.shared_head = SharedHead(spec, own_head)
        self.embed_tokens = TokenEmbedding(spec.vocab, spec.hidden) if own_embed else None

    def forward(self, embeds: torch.Tensor, previous: torch.Tensor,  # type: ignore[override]
                cos: torch.Tensor, sin: torch.Tensor, ctx) -> torch.Tensor:
        """The layer's output at each row (before ``shared_head.norm``): ``embeds`` are the next tokens'
        embeddings, ``previous`` the main model's (or this layer's previous) hidden states."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(previous.to(embeds.dtype))], dim=-1))
        return super().forward(x, cos, sin, ctx)


class DeepseekMTP(nn.Module):
    """The MTP layer under its checkpoint names (``model.layers.N...``), loaded as the main model loads its
    layers: merged ``gate_up_proj`` from ``gate_proj`` + ``up_proj``, routed experts into their stacks."""

    packed_modules: ClassVar[dict[str, list[str]]] = DeepseekV2ForCausalLM.packed_modules
    expert_layout = DeepseekV2ForCausalLM.expert_layout

    def __init__(self, spec: ModelSpec, *, own_head: bool, own_embed: bool):
        super().__init__()
        self.layer_idx = spec.layers
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict(
            {str(spec.layers): DeepseekMTPLayer(spec, spec.layers, own_head=own_head, own_embed=own_embed)})

    @property
    def layer(self) -> DeepseekMTPLayer:
        return self.model.layers[str(self.layer_idx)]  # type: ignore[return-value]

    def load_weights(self, source: WeightSource) -> None:
        load_moe_weights(self, source, self.expert_layout)


def copy_of(source: WeightSource, name: str, original: str) -> bool:
    """Whether checkpoint tensor ``name`` is absent or equal to ``original`` (the main model's is used)."""
    if name not in source:
        return True
    return original in source and torch.equal(source.get(name), source.get(original))
