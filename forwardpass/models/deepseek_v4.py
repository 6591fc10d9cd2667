"""DeepSeek-V4: compressed attention, hyper-connections, hash-routed and top-k MoE.

* **Residual streams** (manifold-constrained hyper-connections): each token carries ``hc_mult`` copies of
  the hidden state. Before attention and before the MoE, a hyper-connection reads all streams (unweighted
  RMSNorm, one linear map ``hc_*_fn``) and gives three weights: ``pre`` collapses the streams into the
  block's input, ``post`` spreads the block's output back over them, and ``comb`` (made
  doubly stochastic by Sinkhorn-Knopp iterations) mixes the old streams into the new ones:
  ``x ← post ⊗ block(norm(Σ pre·x)) + combᵀ·x``. The head collapses them once more (``hc_head``).
* **Attention**: ``deepseek_v4_attention.py`` (sliding window + compressed entries + sink).
* **MoE** (every layer): ``n_routed_experts`` SwiGLU experts with clamped pre-activations
  (``swiglu_limit``) plus one shared expert; scores ``sqrtsoftplus`` (or sigmoid) of the router logits;
  ``hash_moe`` layers choose experts by a frozen token-id table ``tid2eid``, ``moe`` layers by top-k of
  the scores plus a learned bias; the chosen scores are renormalized and times ``routed_scaling_factor``.

Weights are read under the names ``save_pretrained`` writes (DeepSeek's own: ``attn.wq_a``,
``ffn.experts.{e}.w1``, ``hc_attn_fn``, ``head``, ...). MTP layers (``num_nextn_predict_layers``) are
not built, as in transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from forwardpass.attention.compressed import rms_norm
from forwardpass.attention.context import AttentionContext
from forwardpass.layers.linear import Linear
from forwardpass.layers.rotary import RotaryEmbedding
from forwardpass.layers.weight_interface import matmul
from forwardpass.loader.weights import WeightSource
from forwardpass.models.decoder import CausalLM, DecoderModel
from forwardpass.models.deepseek_v4_attention import DeepseekV4Attention, Norm
from forwardpass.models.expert_stacks import ExpertStacks
from forwardpass.models.model_spec import ModelSpec
from forwardpass.models.moe_loading import ExpertCheckpointLayout, load_moe_parameter


def _f32(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=torch.float32), requires_grad=False)


def hyper_weights(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    iters: int,
    eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(post [T, n], comb [T, n, n], collapsed [T, H])`` for streams ``x [T, n, H]``."""
    n = x.shape[1]
    flat = rms_norm(x.reshape(x.shape[0], -1).float(), None, norm_eps)
    pre_w, post_w, comb_w = F.linear(flat, fn.float()).split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):  # Sinkhorn-Knopp: rows and columns sum to one
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return post, comb, (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)


def clamped_glu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, L)) · clamp(up, ±L)``."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, limit: float) -> torch.Tensor:
    """``w2 · (silu(min(gate, L)) · clamp(up, ±L))`` with ``gate, up = w13 · x``."""
    gate, up = matmul(x, w13).chunk(2, dim=-1)
    return matmul(clamped_glu(gate, up, limit), w2)


class SharedExpert(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.w1, self.w2, self.w3 = Linear(hidden, inter), Linear(inter, hidden), Linear(hidden, inter)

    def forward(self, x: torch.Tensor, limit: float) -> torch.Tensor:
        # each projection through its own Linear (its weight method): a weight the plan quantized or packed is
        # no tensor to concatenate; torch.cat of w1's and w3's weights crashed every int8/int4 engine
        return self.w2(clamped_glu(self.w1(x), self.w3(x), limit))


class Router(nn.Module):
    def __init__(self, spec: ModelSpec, hashed: bool):
        super().__init__()
        moe = spec.moe
        assert moe is not None
        self.weight = nn.Parameter(torch.empty(moe.num_experts, spec.hidden), requires_grad=False)
        if hashed:  # token id -> its experts (frozen)
            self.tid2eid = nn.Parameter(
                torch.zeros(spec.vocab, moe.experts_per_tok, dtype=torch.long), requires_grad=False
            )
        else:
            self.bias = _f32(moe.num_experts)  # shifts the choice only, not the weights


class DeepseekV4MoE(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        assert spec.dsv4 is not None and spec.moe is not None
        self.moe, self.limit, self.hashed = spec.moe, spec.dsv4.swiglu_limit, spec.dsv4.hash_layers[layer]
        e, h, i = spec.moe.num_experts, spec.hidden, spec.moe.expert_intermediate
        self.gate = Router(spec, self.hashed)
        # w1 rows, then w3 rows; quantized after loading where the plan quantizes (they were left fp32 before)
        self.experts = ExpertStacks(w13=(e, 2 * i, h), w2=(e, h, i))
        self.shared_experts = SharedExpert(h, spec.moe.shared_expert_intermediate)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        s = self.moe
        logits = F.linear(x, self.gate.weight)
        scores = F.softplus(logits).sqrt() if s.router_scoring == "sqrtsoftplus" else logits.sigmoid()
        if self.hashed:
            ids = self.gate.tid2eid[input_ids]
        else:
            ids = torch.topk(scores + self.gate.bias, s.experts_per_tok, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * s.routed_scaling_factor
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():  # a token may list one expert twice (hash tables): both count
            rows, slot = torch.where(ids == e)
            y = (
                swiglu(x[rows], self.experts.w13[e], self.experts.w2[e], self.limit)
                * weights[rows, slot, None]
            )
            out.index_add_(0, rows, y.to(out.dtype))
        return out + self.shared_experts(x, self.limit)


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        v4 = spec.dsv4
        assert v4 is not None
        self.v4, self.eps, self.compressed = v4, spec.norm.eps, bool(v4.compress_rates[layer])
        self.attn = DeepseekV4Attention(spec, layer)
        self.ffn = DeepseekV4MoE(spec, layer)
        self.attn_norm, self.ffn_norm = Norm(spec.hidden), Norm(spec.hidden)
        mix, width = (2 + v4.hc_mult) * v4.hc_mult, v4.hc_mult * spec.hidden
        for block in ("attn", "ffn"):
            setattr(self, f"hc_{block}_fn", _f32(mix, width))
            setattr(self, f"hc_{block}_base", _f32(mix))
            setattr(self, f"hc_{block}_scale", _f32(3))

    @property
    def mlp(self) -> nn.Module:
        """The MoE under the name the engine's routing statistics look for (not a ``FusedMoE``: none kept)."""
        return self.ffn

    def _mix(self, x: torch.Tensor, block: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        v4 = self.v4
        post, comb, collapsed = hyper_weights(
            x,
            getattr(self, f"hc_{block}_fn"),
            getattr(self, f"hc_{block}_base"),
            getattr(self, f"hc_{block}_scale"),
            v4.hc_sinkhorn_iters,
            v4.hc_eps,
            self.eps,
        )
        out = fn(rms_norm(collapsed, getattr(self, f"{block}_norm").weight, self.eps))
        return post.to(x.dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
            comb.to(x.dtype).transpose(-1, -2), x
        )

    def forward(
        self,
        x: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        rotary: tuple[RotaryEmbedding, RotaryEmbedding],
        ctx: AttentionContext | None,
    ) -> torch.Tensor:
        """``x``: the residual streams ``[T, hc_mult, hidden]``."""
        rot = rotary[1] if self.compressed else rotary[0]
        x = self._mix(x, "attn", lambda h: self.attn(h, positions, rot, ctx))
        return self._mix(x, "ffn", lambda h: self.ffn(h, input_ids))


class HyperHead(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        assert spec.dsv4 is not None
        n = spec.dsv4.hc_mult
        self.hc_fn, self.hc_base, self.hc_scale = _f32(n, n * spec.hidden), _f32(n), _f32(1)


class DeepseekV4Model(DecoderModel):
    """The shell over ``hc_mult`` residual streams: the embedding is copied into each, every layer mixes them,
    and the head's hyper-connection collapses them before the final norm."""

    def __init__(self, spec: ModelSpec):
        v4 = spec.dsv4
        assert v4 is not None
        super().__init__(spec, DeepseekV4DecoderLayer, norm=lambda hidden, eps: Norm(hidden),
                         embedding=nn.Embedding(spec.vocab, spec.hidden, _freeze=True))
        self.v4, self.eps = v4, spec.norm.eps
        self.hc_head = HyperHead(spec)
        # sliding layers rotate with the "main" base, compressed layers (and their entries) with "compress"
        self.rotary = (  # type: ignore[assignment]  # two tables: run_layers passes both
            RotaryEmbedding(v4.rope_dim, spec.rope.theta),
            RotaryEmbedding(v4.rope_dim, v4.compress_rope_theta, v4.compress_rope_scaling),
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids).unsqueeze(1).expand(-1, self.v4.hc_mult, -1).contiguous()

    def run_layers(self, x: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                   ctx: AttentionContext | None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, input_ids, positions, self.rotary, ctx)
        return x

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        h = self.hc_head
        flat = rms_norm(x.flatten(1).float(), None, self.eps)
        pre = (
            torch.sigmoid(F.linear(flat, h.hc_fn.float()) * h.hc_scale.float() + h.hc_base.float())
            + self.v4.hc_eps
        )
        return rms_norm((pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype), self.norm.weight, self.eps)


class DeepseekV4ForCausalLM(CausalLM):
    checkpoint_renames: ClassVar[dict[str, str]] = {"lm_head": "head"}  # DeepSeek's own name for the LM head
    #: the routed experts from their per-expert ``w1`` / ``w3`` / ``w2`` tensors into the stacks
    expert_layout = ExpertCheckpointLayout(block="ffn", stacks={"w13": ("w1", "w3"), "w2": ("w2",)})

    def __init__(self, spec: ModelSpec):
        super().__init__(spec, tied=False)

    def build_decoder(self, spec: ModelSpec) -> DeepseekV4Model:
        return DeepseekV4Model(spec)

    def load_parameter(self, name: str, param: torch.Tensor, source: WeightSource) -> None:
        if not load_moe_parameter(self, name, param, source, self.expert_layout):
            super().load_parameter(name, param, source)
