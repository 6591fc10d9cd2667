"""Multi-latent attention: the latent-only KV cache, absorbed == expanded, DeepSeek-V2/V3 against
transformers, a byte budget that fits only the latent cache, and bad MLA configs."""

from __future__ import annotations

import json

import pytest
import torch

from forwardpass import LLM, SamplingParams
from forwardpass.attention.mla import absorbed_attention, expanded_attention, gather_latent, write_latent
from forwardpass.engine.scheduling.kv_cache_spec import MLASpec, layer_specs
from forwardpass.errors import ForwardpassError
from forwardpass.models.model_spec import ModelSpec, load_model_spec
from tests.helpers.attention_checkpoints import make_attention_checkpoint
from tests.helpers.checkpoints import random_prompts
from tests.helpers.oracle import hf_greedy, hf_model

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cache = {}

    def make(variant):
        if variant not in cache:
            cache[variant] = make_attention_checkpoint(tmp_path_factory.mktemp(variant), variant)
        return cache[variant]

    return make


@pytest.mark.parametrize("backend", ["naive", "sdpa", "flash"])
def test_absorbed_decode_equals_expanded(backend):
    g = torch.Generator().manual_seed(0)
    heads, rank, nope, rope, v_dim, bs = 4, 32, 16, 8, 16, 4
    lengths = [7, 13, 1, 20]
    cache = torch.zeros(32, bs, rank + rope)
    perm = torch.randperm(32, generator=g).tolist()
    tables = []
    for n in lengths:  # each sequence's latents in scattered blocks
        table = [perm.pop() for _ in range(-(-n // bs))]
        pos = torch.arange(n)
        write_latent(cache, torch.randn(n, rank + rope, generator=g),
                     torch.tensor(table)[pos // bs] * bs + pos % bs)
        tables.append(table + [0] * (5 - len(table)))
    tables_t = torch.tensor(tables)
    kv_b = torch.randn(heads * (nope + v_dim), rank, generator=g) * 0.2
    q = torch.randn(len(lengths), heads, nope + rope, generator=g)
    latent = gather_latent(cache, tables_t, max(lengths))
    mask = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
    kw = {"rank": rank, "nope": nope, "scale": 0.2, "backend": backend}
    absorbed = absorbed_attention(q, latent, kv_b, key_padding_mask=mask, **kw)
    for b, n in enumerate(lengths):  # the expanded form, one sequence at a time, no padding
        expanded = expanded_attention(q[b : b + 1, :, None], latent[b : b + 1, :n], kv_b, causal=True, **kw)
        torch.testing.assert_close(absorbed[b], expanded[0, :, 0], atol=1e-5, rtol=0)


def test_latent_cache_spec_and_bytes(ckpt):
    spec = load_model_spec(ckpt("deepseek_v3"))
    (mla,) = set(layer_specs(spec, 16, torch.float32))
    assert isinstance(mla, MLASpec) and mla.latent_dim == 32 + 8
    assert mla.page_bytes_per_layer == 16 * 40 * 4
    assert spec.kv_bytes_per_token(2) == spec.layers * 40 * 2  # the analyzer's per-token KV: latent only


@pytest.mark.parametrize("variant", ["deepseek_v2", "deepseek_v3"])
def test_deepseek_matches_transformers_alone_and_batched(ckpt, variant):
    path = ckpt(variant)
    hf = hf_model(path)
    prompts = random_prompts(3, [45, 9, 70], seed=3)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(path, num_kv_blocks=64, block_size=8, max_num_batched_tokens=16)  # chunked prefill
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    expected = [hf_greedy(hf, p, 16) for p in prompts]
    assert batched == expected, variant
    assert llm.generate([prompts[0]], params, use_tqdm=False)[0].outputs[0].token_ids == expected[0]
    llm.engine.check_invariants()
    with torch.no_grad():
        ref = hf(torch.tensor([prompts[2]])).logits[0].float()
        ours = llm.engine.model.compute_logits(llm.engine.model(torch.tensor(prompts[2]), torch.arange(70)))
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    assert llm.engine.core.routing_stats is not None  # the MoE layers report their expert loads


def test_deepseek_v3_serves_from_a_budget_only_the_latent_cache_fits(ckpt):
    path = ckpt("deepseek_v3")
    spec = load_model_spec(path)
    max_len, per_token = 128, spec.kv_bytes_per_token(4)  # 3 layers x 40 floats
    budget = 16 * 16 * int(per_token)  # 16 blocks of 16 tokens of latents
    expanded_per_token = (spec.layers * spec.heads
                          * (spec.mla.qk_nope_head_dim + spec.mla.qk_rope_head_dim + spec.mla.v_head_dim) * 4)
    assert expanded_per_token * max_len > budget  # expanded K/V of one max-length sequence would not fit
    llm = LLM(path, kv_cache_memory=budget, block_size=16, max_model_len=max_len, max_num_batched_tokens=32)
    assert llm.engine.core.kv.num_blocks == 16
    prompts = random_prompts(3, [40, 25, 60], seed=5)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    hf = hf_model(path)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 40) for p in prompts]
    llm.engine.check_invariants()
    assert llm.engine.core.kv.num_free_blocks == 16


BASE_CFG = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
            "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 256, "kv_lora_rank": 32,
            "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8,
            "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "moe_intermediate_size": 32}


@pytest.mark.parametrize("extra,param", [
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
    ({"v_head_dim": None}, "v_head_dim"),
    ({"head_dim": 20}, "head_dim"),
    ({"n_group": 3}, "n_group"),
    ({"topk_group": 1, "num_experts_per_tok": 3}, "topk_group"),
])
def test_bad_mla_configs_name_the_field(extra, param, tmp_path):
    cfg = {**BASE_CFG, **extra}
    with pytest.raises(ForwardpassError) as err:
        ModelSpec.from_config(cfg)
    assert err.value.param == param
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ForwardpassError) as err:
        LLM(tmp_path)
    assert err.value.param == param
