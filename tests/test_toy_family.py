"""A new architecture added from outside ``forwardpass/``: this module defines a toy family (its spec
derivation, its model with a layer and a cache kind of its own, that kind's metadata builder), registers it
through the public registry, writes a random checkpoint (config.json + safetensors) and generates through
``forwardpass.LLM``. No file of the package is edited for it: the engine asks the family's derivation for the
spec, the model's layers for their caches, and each cache kind for its metadata builder
(docs/adding-a-model.md walks through the same steps). A second toy family keeps a state of its own per
request: the accounting, the engine's cost model and the roofline analyzer count it through the family's
terms (``models/family.py``), again without an edit to the package.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from forwardpass import LLM, SamplingParams
from forwardpass.analysis.roofline import analyze
from forwardpass.attention.context import AttentionContext, GroupMetadata
from forwardpass.attention.kv_cache_interface import FullAttentionSpec, KVCacheSpec
from forwardpass.attention.layer import CachedAttention
from forwardpass.attention.metadata import GroupMetadataBuilder
from forwardpass.engine.scheduling.cost import StepCostModel
from forwardpass.engine.scheduling.kv_cache_spec import layer_specs
from forwardpass.layers.linear import Linear
from forwardpass.layers.norm import RMSNorm
from forwardpass.layers.rotary import RotaryEmbedding, apply_rotary
from forwardpass.loader.weights import WeightSource, load_into
from forwardpass.models import accounting
from forwardpass.models.family import ModelFamily
from forwardpass.models.model_spec import ModelSpec, decoder_spec, load_model_spec
from forwardpass.models.registry import register_model, unregister_model
from forwardpass.models.state_ops import state_layer_ops

ARCH = "ToyForCausalLM"
CONFIG = {
    "architectures": [ARCH], "model_type": "toy", "hidden_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 96,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6, "toy_attention_temperature": 0.5,  # the family's own key
}


# ----- the family's spec: its own key, read by its own derivation -------------------------------------------
@dataclass(frozen=True)
class ToySpec:
    """The toy family's sub-spec (``ModelSpec.family``): attention logits are divided by ``temperature``."""

    temperature: float


def toy_spec(cfg: Mapping[str, Any], name: str) -> ModelSpec:
    temperature = float(cfg.get("toy_attention_temperature") or 1.0)
    return decoder_spec(cfg, name, family=ToySpec(temperature))  # the common keys from the core


# ----- its cache kind and that kind's metadata builder ------------------------------------------------------
class ToyMetadataBuilder(GroupMetadataBuilder):
    """The paged builder, counting the metadata it builds (each step, per group of this kind)."""

    built = 0

    def build(self) -> GroupMetadata:
        ToyMetadataBuilder.built += 1
        return super().build()


@dataclass(frozen=True)
class ToyKVSpec(FullAttentionSpec):
    """K and V pages as full attention keeps them, with a metadata builder of its own."""

    metadata_builder_cls: ClassVar[Any] = ToyMetadataBuilder


# ----- its model: a Llama-like decoder with its own attention layer -----------------------------------------
class ToyCachedAttention(CachedAttention):
    """Paged attention (reused) whose cache is the toy kind."""

    def kv_cache_spec(self, spec: ModelSpec, block_size: int,
                      dtype: torch.dtype) -> dict[int, KVCacheSpec | None]:
        return {self.layer_idx: ToyKVSpec(block_size=block_size, num_kv_heads=spec.kv_heads,
                                          head_dim=spec.head_dim, dtype=dtype)}


class ToyLayer(nn.Module):
    """Pre-norm attention with a temperature, then a non-gated GELU MLP."""

    def __init__(self, spec: ModelSpec, layer_idx: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = spec.heads, spec.kv_heads, spec.head_dim
        self.attn_norm = RMSNorm(spec.hidden, spec.norm.eps)
        self.q_proj = Linear(spec.hidden, spec.q_dim)
        self.k_proj = Linear(spec.hidden, spec.kv_dim)
        self.v_proj = Linear(spec.hidden, spec.kv_dim)
        self.o_proj = Linear(spec.q_dim, spec.hidden)
        scale = spec.head_dim**-0.5 / spec.family.temperature
        self.attn = ToyCachedAttention(layer_idx, scale=scale)
        self.mlp_norm = RMSNorm(spec.hidden, spec.norm.eps)
        self.up_proj = Linear(spec.hidden, spec.intermediate)
        self.down_proj = Linear(spec.intermediate, spec.hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext | None):
        t, h = x.shape[0], self.attn_norm(x)
        q = apply_rotary(self.q_proj(h).view(t, self.heads, self.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(h).view(t, self.kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(h).view(t, self.kv_heads, self.head_dim)
        x = x + self.o_proj(self.attn(q, k, v, ctx).reshape(t, -1))
        return x + self.down_proj(F.gelu(self.up_proj(self.mlp_norm(x))))


class ToyForCausalLM(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab, spec.hidden)
        self.layers = nn.ModuleList(ToyLayer(spec, i) for i in range(spec.layers))
        self.norm = RMSNorm(spec.hidden, spec.norm.eps)
        self.rotary = RotaryEmbedding(spec.head_dim, spec.rope.theta, spec.rope.scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext | None = None):
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, ctx)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.embed_tokens.weight.T).float()  # tied head

    def load_weights(self, source: WeightSource) -> None:
        for name, param in self.named_parameters():
            load_into(param, source, name)


# ----- the test ---------------------------------------------------------------------------------------------
@pytest.fixture
def toy_dir(tmp_path):
    register_model(ARCH, ToyForCausalLM, spec=toy_spec, model_types=("toy",))
    try:
        model = ToyForCausalLM(load_spec_from(CONFIG))
        gen = torch.Generator().manual_seed(0)
        weights = {}
        for name, param in model.named_parameters():
            values = 1.0 + 0.1 * torch.randn(param.shape, generator=gen) \
                if name.endswith("norm.weight") else \
                0.3 * torch.randn(param.shape, generator=gen)
            weights[name] = values.contiguous()
        (tmp_path / "config.json").write_text(json.dumps(CONFIG))
        save_file(weights, str(tmp_path / "model.safetensors"))
        yield tmp_path
    finally:
        unregister_model(ARCH)


def load_spec_from(cfg: Mapping[str, Any]) -> ModelSpec:
    return ModelSpec.from_config(cfg, "toy")


def reference_greedy(model: ToyForCausalLM, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens recomputed over the whole sequence each step, without any cache (``ctx=None``)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            hidden = model(torch.tensor(ids), torch.arange(len(ids)))
            ids.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
    return ids[len(prompt):]


def test_a_toy_family_registered_from_a_test_module_runs_through_the_engine(toy_dir):
    spec = load_model_spec(toy_dir)
    # the family's derivation read its own key
    assert spec.architecture == ARCH and spec.family == ToySpec(0.5)
    specs = layer_specs(spec, 8, torch.float32)
    assert [type(s) for s in specs] == [ToyKVSpec, ToyKVSpec]  # the layers declared their caches

    ToyMetadataBuilder.built = 0
    llm = LLM(str(toy_dir), num_kv_blocks=32, block_size=8, cpu_kernels=False)
    prompts = [[5, 17, 3, 44, 9], [71, 2, 30]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)

    core = llm.engine.core
    assert [type(g.spec) for g in core.kv.groups] == [ToyKVSpec]  # the engine planned the toy cache kind
    assert ToyMetadataBuilder.built > 0  # and built its attention metadata with the kind's builder
    assert isinstance(core.model, ToyForCausalLM) and core.spec.family == ToySpec(0.5)
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == reference_greedy(core.model, prompt, 6)


# ----- a family with a cache of its own: a state per request, counted by its own terms ----------------------
STATE_ARCH = "ToyStateForCausalLM"
TOY_STATE = "toy_state"  # its mixer: a fixed-size state per request (no K/V)


@dataclass(frozen=True)
class ToyStateSpec(ModelFamily):
    """Layers after the first mix tokens through a ``[width, width]`` state per request (like linear
    attention): the family says what that costs; the ordinary decoder's terms cover the rest."""

    width: int

    def mixer_params(self, s: ModelSpec) -> int:
        return super().mixer_params(s) + self.state_layers(s) * 3 * s.hidden * self.width

    def state_bytes_per_sequence(self, s: ModelSpec, state_bytes: float) -> float:
        return self.state_layers(s) * self.width * self.width * state_bytes

    def state_flops_per_token(self, s: ModelSpec) -> float:
        return 8.0 * self.state_layers(s) * self.width * self.width

    def mixer_ops(self, s, stage, *, tokens, batch, wb, ab):
        w = self.width
        return state_layer_ops("gdn", self.state_layers(s), stage, tokens=tokens, batch=batch,
                               hidden=s.hidden, proj_out=3 * w, conv_dim=w, inner=w, conv_kernel=1,
                               values=w * w, state_values=w * w, wb=wb, ab=ab)

    @staticmethod
    def state_layers(s: ModelSpec) -> int:
        return sum(1 for m in s.layer_mixers if m == TOY_STATE)


def toy_state_spec(cfg: Mapping[str, Any], name: str) -> ModelSpec:
    layers = int(cfg["num_hidden_layers"])
    return decoder_spec(cfg, name, layer_mixers=("attention",) + (TOY_STATE,) * (layers - 1),
                        family=ToyStateSpec(int(cfg["toy_state_width"])))


def test_a_family_with_its_own_state_is_counted_by_its_terms_through_accounting_cost_and_roofline():
    register_model(STATE_ARCH, ToyForCausalLM, spec=toy_state_spec)
    try:
        cfg = {**CONFIG, "architectures": [STATE_ARCH], "num_hidden_layers": 3, "toy_state_width": 8}
        spec = ModelSpec.from_config(cfg, "toy-state")
        plain = ModelSpec.from_config({**CONFIG, "num_hidden_layers": 3}, "plain")  # the ordinary decoder
        assert isinstance(spec.family, ToyStateSpec) and spec.attention_layers == 1
        # the accounting: K/V of the one attention layer, the family's state, its parameters
        assert spec.kv_bytes_per_token(2) == 2 * 1 * spec.kv_dim * 2
        assert spec.state_bytes_per_sequence(4) == 2 * 8 * 8 * 4
        assert accounting.cache_bytes_per_sequence(spec, 100, 2) == (spec.kv_bytes_per_token(2) * 100
                                                                      + 2 * 8 * 8 * 4)
        assert spec.params - plain.params == 2 * 3 * 32 * 8 - 2 * spec.attention_params
        assert spec.state_flops_per_token == 8.0 * 2 * 8 * 8
        # the engine's cost model reads the state once and writes it once per sequence and step
        cost = StepCostModel(spec, 4)
        (flops, one), (_, two) = cost.step([(10, 1)], 1), cost.step([(10, 1), (10, 1)], 1)
        assert flops > 0 and two - one >= 2 * spec.state_bytes_per_sequence(4)
        # the roofline: the family's ops in the table, its state as KV traffic
        report = analyze(spec, "h100", prefill_tokens=16, context=64, batches=(1,))
        names = {op.name for op in report.decode[0].ops}
        assert {"gdn.in_proj", "gdn.scan", "gdn.out_proj"} <= names and "q_proj" in names
        scan = next(op for op in report.decode[0].ops if op.name == "gdn.scan")
        assert scan.count == 2 and scan.kv_read_bytes == spec.state_bytes_per_sequence(4)  # batch 1
    finally:
        unregister_model(STATE_ARCH)
