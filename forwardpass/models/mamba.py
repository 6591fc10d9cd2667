"""Mamba2 and Nemotron-H: decoders whose layers keep a fixed-size state instead of a growing KV cache.

Both store ``backbone.embeddings``, ``backbone.layers.{i}.norm`` + ``.mixer``, ``backbone.norm_f`` and
``lm_head``; each layer is ``x + mixer(RMSNorm(x))``. The mixer is per layer
(``ModelSpec.layer_mixers``):

* **Mamba2** (``MIXER_MAMBA``, every Mamba2 layer): ``in_proj`` gives the gate ``z``, the conv input
  ``xBC`` and ``dt``; a depthwise causal conv (``conv_kernel`` taps, SiLU) over ``xBC``; the selective
  SSM (``layers/ssd.py``: chunked SSD scan for prefill chunks, recurrent update for one-token rows);
  the gated RMSNorm with ``z``; ``out_proj``. Its state (the last ``conv_kernel - 1`` conv inputs and
  the SSM state) lives in the layer's state slot (``StateSpec``, ``ctx.for_state``): read at the
  start of a chunk that continues a sequence, zero at position 0, written back at the end.
* **attention** (``MIXER_ATTENTION``, Nemotron-H ``*``): plain multi-head attention with GQA and no
  positional encoding over the paged KV cache (``CachedAttention``);
* **MLP** (``MIXER_MLP``, Nemotron-H ``-``): ``down(relu²(up(x)))``.

* **MoE** (``MIXER_MOE``, Nemotron-H ``E``): DeepSeek-V3 routing over non-gated relu² experts plus a
  shared expert (``moe_latent_size`` projections are not supported).

Nemotron-H's pattern (``layers_block_type`` / ``hybrid_override_pattern``) puts Mamba layers (state
slots) and attention layers (paged blocks) in one model and one batch.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from forwardpass.attention.context import AttentionContext
from forwardpass.attention.kv_cache_interface import KVCacheSpec, StateSpec
from forwardpass.attention.layer import CachedAttention
from forwardpass.layers.activation import get_activation
from forwardpass.layers.linear import Linear, MergedLinear
from forwardpass.layers.norm import RMSNorm
from forwardpass.layers.ssd import causal_conv, causal_conv_step, gated_rms_norm, ssd_scan, ssm_step
from forwardpass.layers.weight_interface import matmul
from forwardpass.loader.weights import WeightSource
from forwardpass.models.decoder import CausalLM, DecoderModel
from forwardpass.models.deepseek import DeepseekMoE
from forwardpass.models.expert_stacks import ExpertStacks
from forwardpass.models.mamba_spec import SSMSpec
from forwardpass.models.model_spec import MIXER_ATTENTION, MIXER_MAMBA, MIXER_MOE, ModelSpec
from forwardpass.models.moe_loading import ExpertCheckpointLayout, load_moe_parameter


class Conv1d(nn.Module):
    """The depthwise conv's parameters, stored as HF's ``nn.Conv1d`` stores them (``[C, 1, K]``)."""

    def __init__(self, channels: int, kernel: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(channels), requires_grad=False) if bias else None


class Mamba2Mixer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int):
        super().__init__()
        assert spec.ssm is not None
        s: SSMSpec = spec.ssm
        self.s, self.layer_idx = s, layer_idx
        self.in_proj = Linear(spec.hidden, s.inner + s.conv_dim + s.heads, bias=s.bias)
        self.conv1d = Conv1d(s.conv_dim, s.conv_kernel, s.conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(s.heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(s.heads), requires_grad=False)
        self.D = nn.Parameter(torch.empty(s.heads), requires_grad=False)
        self.norm = RMSNorm(s.inner, s.norm_eps)  # only its weight: the gated form is gated_rms_norm
        self.out_proj = Linear(s.inner, spec.hidden, bias=s.bias)

    def kv_cache_spec(self, spec: ModelSpec, block_size: int,
                      dtype: torch.dtype) -> dict[int, KVCacheSpec | None]:
        """One float32 slot per request: the conv window, then the SSM state."""
        return {self.layer_idx: StateSpec(block_size=block_size, state_size=self.s.state_size)}

    def forward(self, x: torch.Tensor, ctx: AttentionContext | None) -> torch.Tensor:
        s = self.s
        z, xbc, dt = self.in_proj(x).split([s.inner, s.conv_dim, s.heads], dim=-1)
        dt = torch.nn.functional.softplus(dt.float() + self.dt_bias.float())
        y = torch.empty(x.shape[0], s.heads, s.head_dim, dtype=torch.float32, device=x.device)
        if ctx is None:  # one sequence from position 0, nothing kept
            y[:] = self._prefill(xbc, dt, None)[0]
        else:
            cache, meta = ctx.kv_caches[self.layer_idx], ctx.for_state(self.layer_idx)
            nd = meta.decode_slots.shape[0]
            if nd:
                state = cache[meta.decode_slots] * meta.decode_has_initial[:, None]
                y[:nd], cache[meta.decode_slots] = self._decode(xbc[:nd], dt[:nd], state)
            for span in meta.prefills:
                rows = slice(span.q_start, span.q_start + span.q_len)
                y[rows], cache[span.slot] = self._prefill(xbc[rows], dt[rows], cache[span.slot] if
                                                          span.has_initial_state else None)
        out = gated_rms_norm(y.reshape(x.shape[0], s.inner), z, self.norm.weight, s.groups, s.norm_eps)
        return self.out_proj(out.to(x.dtype))

    def _split(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.s
        xs, b, c = xbc.split([s.inner, s.groups * s.state, s.groups * s.state], dim=-1)
        lead = xbc.shape[:-1]
        return xs.reshape(*lead, s.heads, s.head_dim), b.reshape(*lead, s.groups, s.state), c.reshape(
            *lead, s.groups, s.state)

    def _prefill(self, xbc: torch.Tensor, dt: torch.Tensor, state: torch.Tensor | None):
        """One sequence's chunk ``[L, ...]`` from its carried state (None: position 0) → (y, new state)."""
        s = self.s
        k1 = s.conv_kernel - 1
        window = (state[: s.conv_state_size].view(s.conv_dim, k1) if state is not None
                  else xbc.new_zeros(s.conv_dim, k1))
        ssm0 = state[s.conv_state_size:].view(s.heads, s.head_dim, s.state) if state is not None else None
        conv, window = causal_conv(xbc, window, self.conv1d.weight[:, 0], self.conv1d.bias)
        xs, b, c = self._split(conv)
        a = -torch.exp(self.A_log.float())
        y, final = ssd_scan(xs, dt.clamp(s.dt_min, s.dt_max), a, b, c, self.D, s.chunk, ssm0)
        return y, torch.cat([window.reshape(-1).float(), final.reshape(-1)])

    def _decode(self, xbc: torch.Tensor, dt: torch.Tensor, state: torch.Tensor):
        """One token per sequence, ``[B, ...]``, states ``[B, state_size]`` → (y, new states)."""
        s = self.s
        n = xbc.shape[0]
        window = state[:, : s.conv_state_size].view(n, s.conv_dim, s.conv_kernel - 1)
        ssm0 = state[:, s.conv_state_size:].view(n, s.heads, s.head_dim, s.state)
        conv, window = causal_conv_step(xbc, window, self.conv1d.weight[:, 0], self.conv1d.bias)
        xs, b, c = self._split(conv)
        # HF's recurrent path does not clamp dt (its scan does, to time_step_limit)
        y, new = ssm_step(ssm0, xs, dt, -torch.exp(self.A_log.float()), b, c, self.D)
        return y, torch.cat([window.reshape(n, -1).float(), new.reshape(n, -1)], dim=-1)


class NemotronHAttention(nn.Module):
    """Multi-head attention without positional encoding (Nemotron-H ``*`` layers)."""

    def __init__(self, spec: ModelSpec, layer_idx: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = spec.heads, spec.kv_heads, spec.head_dim
        self.qkv_proj = MergedLinear(spec.hidden,
                                     {"q_proj": spec.q_dim, "k_proj": spec.kv_dim, "v_proj": spec.kv_dim},
                                     bias=spec.biases.qkv)
        self.o_proj = Linear(spec.q_dim, spec.hidden, bias=spec.biases.o)
        self.attn = CachedAttention(layer_idx, scale=spec.head_dim**-0.5)

    def forward(self, x: torch.Tensor, ctx: AttentionContext | None) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        out = self.attn(q.view(t, self.heads, -1), k.view(t, self.kv_heads, -1), v.view(t, self.kv_heads, -1),
                        ctx)
        return self.o_proj(out.reshape(t, -1))


class PlainMLP(nn.Module):
    """``down(act(up(x)))`` (Nemotron-H ``-`` layers, relu²)."""

    def __init__(self, spec: ModelSpec, intermediate: int | None = None):
        super().__init__()
        inter = intermediate or spec.intermediate
        self.up_proj = Linear(spec.hidden, inter, bias=spec.biases.mlp)
        self.down_proj = Linear(inter, spec.hidden, bias=spec.biases.mlp)
        self.act = get_activation(spec.hidden_act)

    def forward(self, x: torch.Tensor, ctx: AttentionContext | None) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class NemotronHMoE(nn.Module):
    """Nemotron-H ``E`` layers: DeepSeek-V3 routing (sigmoid scores, ``e_score_correction_bias``-corrected
    group choice, renormalized, times ``routed_scaling_factor``) over non-gated relu² experts
    (``up_proj [E, I, H]``, ``down_proj [E, H, I]``), plus the always-on shared expert."""

    route = DeepseekMoE.route  # the same routing as DeepSeek-V3 (reads moe, gate, top_k, renormalize)

    def __init__(self, spec: ModelSpec):
        super().__init__()
        moe = spec.moe
        assert moe is not None
        self.moe = moe
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.empty(moe.num_experts, spec.hidden), requires_grad=False)
        self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(moe.num_experts), requires_grad=False)
        self.top_k, self.renormalize = moe.experts_per_tok, moe.renormalize_topk
        e, i = moe.num_experts, moe.expert_intermediate
        # quantized after loading where the plan quantizes (they were left fp32 before)
        self.experts = ExpertStacks(up_proj=(e, i, spec.hidden), down_proj=(e, spec.hidden, i))
        self.shared_experts = PlainMLP(spec, moe.shared_expert_intermediate)
        self.act = get_activation(spec.hidden_act)

    def forward(self, x: torch.Tensor, ctx: AttentionContext | None) -> torch.Tensor:
        weights, ids = self.route(x)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in ids.unique().tolist():
            rows, slot = torch.where(ids == e)
            h = self.act(matmul(x[rows], self.experts.up_proj[e]))
            out.index_add_(0, rows, matmul(h, self.experts.down_proj[e]).float() * weights[rows, slot, None])
        return out.to(x.dtype) + self.shared_experts(x, ctx)


class MambaBlock(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int):
        super().__init__()
        self.norm = RMSNorm(spec.hidden, spec.norm.eps)
        kind = spec.mixer(layer_idx)
        self.mixer: nn.Module = (Mamba2Mixer(spec, layer_idx) if kind == MIXER_MAMBA
                                 else NemotronHAttention(spec, layer_idx) if kind == MIXER_ATTENTION
                                 else NemotronHMoE(spec) if kind == MIXER_MOE else PlainMLP(spec))

    def forward(self, x: torch.Tensor, ctx: AttentionContext | None) -> torch.Tensor:
        return x + self.mixer(self.norm(x), ctx)


class MambaBackbone(DecoderModel):
    """The shell without positions: each block is called as ``block(x, ctx)``."""

    def __init__(self, spec: ModelSpec):
        super().__init__(spec, MambaBlock)


class Mamba2ForCausalLM(CausalLM):
    """Also Nemotron-H's class: the spec's ``layer_mixers`` decides each layer's mixer."""

    packed_modules: ClassVar[dict[str, list[str]]] = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    decoder_attribute = "backbone"
    checkpoint_renames: ClassVar[dict[str, str]] = {"backbone.embed_tokens": "backbone.embeddings",
                                                    "backbone.norm": "backbone.norm_f"}
    #: Nemotron-H's relu² experts: ``mixer.experts.{e}.up_proj`` / ``down_proj``, or the stacks as stored
    expert_layout = ExpertCheckpointLayout(
        block="mixer", stacks={"up_proj": ("up_proj",), "down_proj": ("down_proj",)})

    def build_decoder(self, spec: ModelSpec) -> MambaBackbone:
        return MambaBackbone(spec)

    def load_parameter(self, name: str, param: torch.Tensor, source: WeightSource) -> None:
        if not load_moe_parameter(self, name, param, source, self.expert_layout):
            super().load_parameter(name, param, source)


class NemotronHForCausalLM(Mamba2ForCausalLM):
    pass
