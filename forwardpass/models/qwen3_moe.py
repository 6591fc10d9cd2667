"""Qwen3-MoE: the Qwen3 decoder (q/k RMSNorm) whose MLPs are, in the sparse layers, a softmax router
over ``num_experts`` gated MLPs of width ``moe_intermediate_size`` with ``num_experts_per_tok`` chosen
per token (renormalized over the chosen ones when ``norm_topk_prob``).

A layer is sparse when it is not in ``mlp_only_layers`` and ``(layer + 1) % decoder_sparse_step == 0``;
the others keep a dense MLP of width ``intermediate_size`` (as in HF ``Qwen3MoeDecoderLayer``).
"""

from __future__ import annotations

from torch import nn

from forwardpass.layers.moe import ExpertCheckpointLayout, FusedMoE, MoECausalLMMixin
from forwardpass.loader.config import ModelConfig
from forwardpass.models.llama import DecoderLayer
from forwardpass.models.qwen3 import Qwen3ForCausalLM


def num_experts(cfg: ModelConfig) -> int:
    # transformers 5 writes `num_local_experts`; Qwen's own (and older) configs say `num_experts`
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


def is_sparse_layer(cfg: ModelConfig, layer_idx: int) -> bool:
    step = int(cfg.get("decoder_sparse_step") or 1)
    return (layer_idx not in (cfg.get("mlp_only_layers") or [])
            and num_experts(cfg) > 0 and (layer_idx + 1) % step == 0)


class Qwen3MoeDecoderLayer(DecoderLayer):
    def build_mlp(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        if not is_sparse_layer(cfg, layer_idx):
            return super().build_mlp(cfg, layer_idx)
        return FusedMoE(cfg["hidden_size"], num_experts(cfg), cfg["moe_intermediate_size"],
                        int(cfg["num_experts_per_tok"]), renormalize=bool(cfg.get("norm_topk_prob", False)),
                        hidden_act=cfg.get("hidden_act", "silu"))


class Qwen3MoeForCausalLM(MoECausalLMMixin, Qwen3ForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer
    expert_layout = ExpertCheckpointLayout(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")
