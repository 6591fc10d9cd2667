"""The decoder layer of the Llama-family MoE architectures (Mixtral, Qwen3-MoE): a sparse MoE block
(router + stacked experts, ``layers/moe.FusedMoE``) in the layers the spec lists in ``moe.layer_ids``,
the dense gated MLP in the others.

``ModelSpec`` resolves the layout from config.json once: which layers are sparse (``decoder_sparse_step``,
``mlp_only_layers``), how many experts (``num_experts`` / ``num_local_experts``), how wide
(``moe_intermediate_size``, or Mixtral's ``intermediate_size``), top-k and whether the chosen experts'
weights are renormalized (always for Mixtral, ``norm_topk_prob`` for Qwen).
"""

from __future__ import annotations

from torch import nn

from forwardpass.layers.moe import FusedMoE
from forwardpass.models.llama import DecoderLayer
from forwardpass.models.model_spec import ModelSpec
from forwardpass.plan import current_plan


class MoEDecoderLayer(DecoderLayer):
    def build_mlp(self, spec: ModelSpec, layer_idx: int) -> nn.Module:
        moe = spec.moe
        if moe is None or layer_idx not in moe.layer_ids:
            return super().build_mlp(spec, layer_idx)
        # experts partitioned (expert parallel) or each one split
        if (tp := current_plan().tensor_parallel).enabled:
            from forwardpass.layers.parallel_moe import ParallelFusedMoE

            return ParallelFusedMoE(spec.hidden, moe.num_experts, moe.expert_intermediate,
                                    moe.experts_per_tok, renormalize=moe.renormalize_topk,
                                    hidden_act=spec.hidden_act, tp=tp)
        return FusedMoE(spec.hidden, moe.num_experts, moe.expert_intermediate, moe.experts_per_tok,
                        renormalize=moe.renormalize_topk, hidden_act=spec.hidden_act)
