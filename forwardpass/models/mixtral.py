"""Mixtral: the Mistral decoder with every MLP a sparse MoE block: ``num_local_experts`` gated MLPs,
``num_experts_per_tok`` chosen per token by top-k of the router logits and weighted by a softmax over
the chosen ones (= softmax over all, then renormalized, which is how ``layers/moe.route`` does it).
Checkpoints name the block ``block_sparse_moe`` and the expert projections ``w1`` (gate), ``w3`` (up),
``w2`` (down); transformers 5 keeps them stacked under ``mlp.experts`` in memory (both load).

``ModelSpec`` resolves the rest: every layer sparse, experts ``intermediate_size`` wide, renormalized
top-k, and ``sliding_window`` (when set) on every layer, as in HF Mixtral.
"""

from __future__ import annotations

from forwardpass.models.llama import LlamaForCausalLM
from forwardpass.models.moe import MoEDecoderLayer
from forwardpass.models.moe_loading import MIXTRAL_EXPERT_LAYOUT, MoECausalLMMixin


class MixtralForCausalLM(MoECausalLMMixin, LlamaForCausalLM):
    batch_invariant_supported = False  # experts multiply a varying number of tokens each: not covered yet
    layer_cls = MoEDecoderLayer
    expert_layout = MIXTRAL_EXPERT_LAYOUT  # block_sparse_moe.experts.{e}.w1 / w3 / w2
