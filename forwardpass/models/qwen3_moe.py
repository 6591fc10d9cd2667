"""Qwen3-MoE: the Qwen3 decoder (q/k RMSNorm) whose MLPs are, in the sparse layers, a softmax router
over ``num_experts`` gated MLPs of width ``moe_intermediate_size`` with ``num_experts_per_tok`` chosen
per token (renormalized over the chosen ones when ``norm_topk_prob``).

A layer is sparse when it is not in ``mlp_only_layers`` and ``(layer + 1) % decoder_sparse_step == 0``
(``MoESpec.layer_ids``); the others keep a dense MLP of width ``intermediate_size`` (as in HF
``Qwen3MoeDecoderLayer``).
"""

from __future__ import annotations

from forwardpass.models.moe import MoEDecoderLayer
from forwardpass.models.moe_loading import QWEN_EXPERT_LAYOUT, MoECausalLMMixin
from forwardpass.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(MoECausalLMMixin, Qwen3ForCausalLM):
    batch_invariant_supported = False  # experts multiply a varying number of tokens each: not covered yet
    layer_cls = MoEDecoderLayer
    expert_layout = QWEN_EXPERT_LAYOUT  # mlp.experts.{e}.gate_proj / up_proj / down_proj
