"""Mixtral: the Mistral decoder with every MLP a sparse MoE block: ``num_local_experts`` gated MLPs,
``num_experts_per_tok`` chosen per token by top-k of the router logits and weighted by a softmax over
the chosen ones (= softmax over all, then renormalized, which is how ``layers/moe.route`` does it).

Checkpoints name the block ``block_sparse_moe`` and the expert projections ``w1`` (gate), ``w3`` (up),
``w2`` (down); transformers 5 keeps them stacked under ``mlp.experts`` in memory (both load).
"""

from __future__ import annotations

from torch import nn

from forwardpass.layers.moe import ExpertCheckpointLayout, FusedMoE, MoECausalLMMixin
from forwardpass.loader.config import ModelConfig
from forwardpass.models.llama import DecoderLayer, LlamaForCausalLM


class MixtralDecoderLayer(DecoderLayer):
    def build_mlp(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        return FusedMoE(cfg["hidden_size"], int(cfg["num_local_experts"]), cfg["intermediate_size"],
                        int(cfg["num_experts_per_tok"]), renormalize=True, hidden_act=cfg.get("hidden_act", "silu"))


class MixtralForCausalLM(MoECausalLMMixin, LlamaForCausalLM):
    layer_cls = MixtralDecoderLayer
    expert_layout = ExpertCheckpointLayout(block="block_sparse_moe", gate="w1", up="w3", down="w2")

    def __init__(self, cfg: ModelConfig):
        # HF Mixtral applies `sliding_window` (when set) to every layer, like Mistral
        if cfg.get("sliding_window") and not cfg.get("layer_types"):
            cfg["layer_types"] = ["sliding_attention"] * cfg["num_hidden_layers"]
        super().__init__(cfg)
