"""Mixture of experts: grouped expert computation vs the per-token reference, routers vs HF, greedy and
logit parity with transformers on tiny random Qwen3-MoE / Mixtral checkpoints, loading layouts, and
the per-step routing statistics."""

from __future__ import annotations

import json

import pytest
import torch

from forwardpass import LLM, SamplingParams
from forwardpass.layers.moe import grouped_experts, reference_experts, route
from tests.helpers.checkpoints import random_prompts
from tests.helpers.moe_checkpoints import MOE_VARIANTS, make_moe_checkpoint
from tests.helpers.oracle import hf_greedy, hf_model

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 20
PROMPT_LENGTHS = [70, 23]


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory):
    cache = {}

    def make(variant: str):
        if variant not in cache:
            cache[variant] = make_moe_checkpoint(tmp_path_factory.mktemp(variant), variant)
        return cache[variant]

    return make


# ----- kernels ------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_tokens,num_experts,top_k",
                         [(1, 8, 2), (37, 8, 1), (29, 16, 2), (13, 8, 8), (5, 16, 3)])
def test_grouped_equals_reference(num_tokens, num_experts, top_k):
    g = torch.Generator().manual_seed(num_tokens * 100 + top_k)
    hidden, inter = 48, 24
    x = torch.randn(num_tokens, hidden, generator=g)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.2
    down = torch.randn(num_experts, hidden, inter, generator=g) * 0.2
    logits = torch.randn(num_tokens, num_experts, generator=g) * 2
    for renormalize in (True, False):
        weights, ids = route(logits, top_k, renormalize)
        ref = reference_experts(x, gate_up, down, weights, ids)
        with torch.inference_mode():  # the engine's mode: takes the oneDNN matmul path
            fast = grouped_experts(x, gate_up, down, weights, ids)
        torch.testing.assert_close(fast, ref, atol=1e-5, rtol=0)
    if top_k < num_experts and num_tokens < num_experts:  # some experts got no token at all
        assert len(set(ids.flatten().tolist())) < num_experts


@pytest.mark.parametrize("top_k,norm", [(1, False), (2, True), (2, False), (8, True)])
def test_route_matches_transformers_routers(top_k, norm):
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = transformers.Qwen3MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=top_k,
                                      norm_topk_prob=norm)
    router = Qwen3MoeTopKRouter(cfg)
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(21, 32, generator=torch.Generator().manual_seed(top_k))
    with torch.no_grad():
        logits, ref_w, ref_ids = router(x)
    weights, ids = route(logits, top_k, norm)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w.float(), atol=1e-6, rtol=0)

    mcfg = transformers.MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=top_k)
    mrouter = MixtralTopKRouter(mcfg)
    mrouter.weight.data.copy_(router.weight.data)
    with torch.no_grad():
        _, ref_w, ref_ids = mrouter(x)
    weights, ids = route(logits, top_k, True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w.float(), atol=1e-6, rtol=0)
    # Mixtral's definition: softmax over the chosen experts' logits
    torch.testing.assert_close(weights, torch.softmax(logits.gather(1, ids), -1), atol=1e-6, rtol=0)


# ----- parity with transformers --------------------------------------------------------------------
@pytest.fixture(scope="module", params=sorted(MOE_VARIANTS))
def variant(request, moe_checkpoint):
    path = moe_checkpoint(request.param)
    return request.param, path, LLM(path, num_kv_blocks=64, block_size=16)


def test_greedy_and_logits_match_transformers(variant):
    name, path, llm = variant
    hf = hf_model(path)
    prompts = random_prompts(2, PROMPT_LENGTHS, seed=1)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NEW_TOKENS), name
    llm.engine.check_invariants()

    prompt = prompts[0]
    model = llm.engine.model
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    with torch.inference_mode():
        ours = model.compute_logits(model(torch.tensor(prompt), torch.arange(len(prompt))))
        model.set_moe_impl("reference")  # the per-token reference gives the same logits
        try:
            ours_ref = model.compute_logits(model(torch.tensor(prompt), torch.arange(len(prompt))))
        finally:
            model.set_moe_impl("grouped")
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(ours, ours_ref, atol=1e-5, rtol=0)


def test_batch_equals_each_alone_and_routing_stats(variant):
    name, _, llm = variant
    spec = llm.engine.model.spec
    prompts = random_prompts(3, [41, 9, 66], seed=3)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm.engine.routing_stats.clear()
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    stats = list(llm.engine.routing_stats)
    step_ids = {r.step for r in llm.engine.stats}
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert together == alone, name

    # one record per forward, per MoE layer: every token is counted top_k times
    top_k, experts = spec.moe.experts_per_tok, spec.moe.num_experts
    sparse = [i for i, _ in llm.engine.model.moe_layers()]
    assert stats and all(r.step in step_ids for r in stats)
    assert sum(r.num_tokens for r in stats) == sum(map(len, prompts)) + 3 * 11
    for r in stats:
        assert r.layers == sparse
        assert all(len(c) == experts and sum(c) == r.num_tokens * top_k for c in r.tokens_per_expert)
    summary = llm.engine.routing_stats.summary()
    assert all(f"{i:>5}" in summary for i in sparse)


def test_sparse_layer_placement(moe_checkpoint):
    from forwardpass.layers.moe import FusedMoE
    from forwardpass.models.loading import load_model

    model, _ = load_model(moe_checkpoint("qwen3_moe_k8_step2"))
    assert [isinstance(layer.mlp, FusedMoE) for layer in model.model.layers] == [False, True, False, True]
    model, _ = load_model(moe_checkpoint("qwen3_moe_k1_e16"))  # mlp_only_layers=[0]
    assert [isinstance(layer.mlp, FusedMoE) for layer in model.model.layers] == [False, True]


def test_dense_model_has_no_routing_stats(checkpoint_factory):
    llm = LLM(checkpoint_factory("qwen3"), num_kv_blocks=16)
    assert llm.engine.routing_stats is None


# ----- loading ------------------------------------------------------------------------------------
def test_stacked_expert_checkpoint_loads(moe_checkpoint, tmp_path):
    """A checkpoint holding transformers-5's in-memory stacked tensors (``mlp.experts.gate_up_proj``)
    loads to the same model as the per-expert one ``save_pretrained`` writes."""
    from safetensors.torch import save_file

    from forwardpass.models.loading import load_model

    src = moe_checkpoint("mixtral_k2")
    hf = hf_model(src)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    a, _ = load_model(src)
    b, _ = load_model(tmp_path)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb), na


def test_expert_count_mismatch_is_reported(moe_checkpoint, tmp_path):
    from forwardpass.errors import ModelLoadError
    from forwardpass.models.loading import load_model

    src = moe_checkpoint("qwen3_moe_k2_norm")
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_local_experts"] = 4  # the checkpoint has 8
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="more experts|shape"):
        load_model(tmp_path)


def test_generate_show_routing(moe_checkpoint, checkpoint_factory, tmp_path, capsys):
    from forwardpass.cli import main
    from tests.helpers.moe_checkpoints import copy_with_tokenizer

    model = copy_with_tokenizer(moe_checkpoint("qwen3_moe_k8_step2"), tmp_path / "moe")
    args = ["generate", "the cat sat", "--model", str(model), "--max-tokens", "5", "--temperature", "0",
            "--ignore-eos", "--show-routing"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "routing over" in err and "max/mean" in err
    table = [line.split() for line in err.splitlines() if line.strip()[:1].isdigit()]
    assert [row[0] for row in table] == ["1", "3"]  # the sparse layers of decoder_sparse_step=2
    dense = copy_with_tokenizer(checkpoint_factory("qwen3"), tmp_path / "dense")
    assert main([*args[:3], str(dense), *args[4:]]) == 0
    assert "no MoE layers" in capsys.readouterr().err
