"""DeepSeek-V4 (sliding window + compressed sparse / heavily compressed attention, hyper-connections,
hash and top-k MoE) against transformers: alone and batched with chunked prefill (prompts longer than
the chunk, the window and both compress rates), prefill logits, chunked == one-shot, preemption by
recompute, abort; and its three cache parts: sliding pages bounded by the window, compressed entries
growing as ``L / m``, the compressor's state constant."""

from __future__ import annotations

import pytest
import torch

from forwardpass import LLM, SamplingParams
from forwardpass.engine.scheduling.compressed_spec import CompressedSpec, SharedKVSlidingSpec
from forwardpass.engine.scheduling.kv_cache_spec import StateSpec, layer_specs, plan_groups
from forwardpass.errors import ForwardpassError
from forwardpass.models.model_spec import ModelSpec, load_model_spec
from tests.helpers.checkpoints import random_prompts
from tests.helpers.deepseek_v4_checkpoints import make_deepseek_v4_checkpoint
from tests.helpers.oracle import hf_greedy, hf_model

pytest.importorskip("transformers")

PROMPTS = random_prompts(3, [45, 9, 70], seed=3)  # > chunk (16), window (12), compress rates (4, 8)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_deepseek_v4_checkpoint(tmp_path_factory.mktemp("dsv4"))


@pytest.fixture(scope="module")
def hf(ckpt):
    return hf_model(ckpt)


@pytest.fixture(scope="module")
def oracle(hf):
    cache: dict[tuple[int, ...], list[int]] = {}

    def get(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in cache:
            cache[tuple(prompt)] = hf_greedy(hf, prompt, 16)
        return cache[tuple(prompt)]

    return get


def _llm(path, **kw) -> LLM:
    return LLM(path, **{"num_kv_blocks": 64, "block_size": 8, "max_num_batched_tokens": 16, **kw})


# ----- the spec and the cache layout ------------------------------------------------------------------
def test_spec_and_cache_layout(ckpt):
    spec = load_model_spec(ckpt)
    v4 = spec.dsv4
    assert v4.compress_rates == (0, 4, 8, 4) and v4.hash_layers == (True, False, False, False)
    assert v4.rope_dim == 16 and v4.compress_rope_scaling["rope_type"] == "yarn" and spec.kv_heads == 1
    specs = layer_specs(spec, 8, torch.float32)
    assert len(specs) == 3 * spec.layers
    assert all(isinstance(s, SharedKVSlidingSpec) and s.sliding_window == 12 for s in specs[:4])
    assert specs[0].cache_shape(5) == (5, 8, 32)  # one plane: the key is the value
    csa, hca = specs[v4.entries_cache_id(1)], specs[v4.entries_cache_id(2)]
    assert isinstance(csa, CompressedSpec) and (csa.compress_rate, csa.entry_dim) == (
        4,
        32 + 16,
    )  # entry + index key
    assert (hca.compress_rate, hca.entry_dim) == (8, 32) and specs[v4.entries_cache_id(0)] is None
    assert specs[v4.entries_cache_id(3)] == csa
    # entries are paged by compressed position: 8 entries per block, one entry per 4 tokens
    assert [csa.blocks_needed(n) for n in (3, 4, 32, 35, 36)] == [0, 1, 1, 1, 2]
    state = specs[v4.state_cache_id(1)]
    assert isinstance(state, StateSpec) and state.blocks_needed(10**6) == 1
    assert state.state_size == (2 * 4 - 1) * 4 * (32 + 16)  # 7 tokens of CSA + indexer kv and gate
    assert specs[v4.state_cache_id(2)].state_size == (8 - 1) * 2 * 32
    groups = plan_groups(specs, None, 40, max_num_seqs=3)
    kinds = sorted((type(g.spec).__name__, g.layer_ids, g.num_blocks) for g in groups)
    assert kinds == [
        ("CompressedSpec", (5, 7), 40),
        ("CompressedSpec", (6,), 40),
        ("SharedKVSlidingSpec", (0, 1, 2, 3), 40),
        ("StateSpec", (9, 11), 3),
        ("StateSpec", (10,), 3),
    ]


# ----- parity with transformers -----------------------------------------------------------------------
def test_matches_transformers_alone_and_batched(ckpt, hf, oracle):
    llm = _llm(ckpt)
    batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    expected = [oracle(p) for p in PROMPTS]
    assert batched == expected
    assert llm.generate([PROMPTS[2]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected[2]
    llm.engine.check_invariants()
    kv = llm.engine.core.kv
    assert kv.num_free_blocks == kv.num_blocks and not kv.enable_prefix_caching
    prompt = torch.tensor(PROMPTS[2])
    with torch.no_grad():
        ref = hf(prompt[None]).logits[0].float()
        ours = llm.engine.model.compute_logits(llm.engine.model(prompt, torch.arange(len(prompt))))
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_bfloat16_matches_transformers(ckpt):
    """In bf16 the float32 parameters (norms, biases, sinks, hyper-connections) and the float32 softmaxes
    must sit where transformers keeps them: prefill logits and chunked greedy tokens agree."""
    import transformers

    hf16 = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    llm = _llm(ckpt, dtype="bfloat16")
    prompt = PROMPTS[0]
    with torch.no_grad():
        ref = hf16(torch.tensor([prompt])).logits[0].float()
        ours = llm.engine.model.compute_logits(
            llm.engine.model(torch.tensor(prompt), torch.arange(len(prompt)))
        )
    torch.testing.assert_close(ours, ref, atol=2e-2, rtol=0)
    tokens = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert tokens == hf_greedy(hf16, prompt, 16)


def test_chunked_prefill_equals_one_shot(ckpt, hf):
    """Budget 7: the compressor state crosses ten chunk boundaries, none aligned with a window; the
    last-token logprobs of both runs and transformers' logits agree."""
    prompt = PROMPTS[2]
    outs = []
    for budget in (7, 256):
        eng = _llm(ckpt, max_num_batched_tokens=budget).engine
        eng.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=5))
        while eng.has_unfinished_requests():
            done = eng.step()
        outs.append(done[0].outputs[0])
    assert outs[0].token_ids == outs[1].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
    a, b = outs[0].logprobs[0], outs[1].logprobs[0]
    assert a.keys() == b.keys()
    for tok in a:
        assert abs(a[tok].logprob - b[tok].logprob) < 1e-4 and abs(a[tok].logprob - float(ref[tok])) < 1e-4


def test_preemption_by_recompute_leaves_outputs_unchanged(ckpt, oracle):
    """8 blocks per group: the three requests cannot all keep their window pages, so some are
    preempted (their compressor state and entries dropped too) and recomputed from position 0."""
    llm = _llm(ckpt, num_kv_blocks=8)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [oracle(p) for p in PROMPTS]
    llm.engine.check_invariants()
    assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.num_blocks


def test_abort_frees_state_and_entries(ckpt):
    llm = _llm(ckpt, max_num_seqs=3)
    eng, kv = llm.engine, llm.engine.core.kv
    for i, p in enumerate(random_prompts(3, [20, 5, 9], seed=1)):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(6):
        eng.step()
    kinds = [type(g.spec).__name__ for g in kv.groups]
    states = [p for p, k in zip(kv.pools, kinds) if k == "StateSpec"]
    assert all(p.num_free == 0 for p in states)  # three running sequences hold all three slots
    held = kv.bytes_in_use
    eng.abort("1")
    eng.check_invariants()
    assert all(p.num_free == 1 for p in states) and kv.bytes_in_use < held
    eng.abort(["0", "2"])
    eng.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks and kv.bytes_in_use == 0


def test_cache_parts_window_bounded_entries_grow_state_constant(ckpt):
    """60 generated tokens of one request: its sliding pages stay within the window's blocks, its
    compressed entries take one block per ``8 · m`` tokens, its compressor states never change size."""
    llm = _llm(ckpt, max_num_batched_tokens=32)
    eng, kv = llm.engine, llm.engine.core.kv
    eng.add_request(
        "r",
        random_prompts(1, [20], seed=2)[0],
        SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
    )
    used: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        eng.step()
        seq = next(iter(eng.core.scheduler.running), None)
        if seq is None:
            break
        for g, table in zip(kv.groups, kv.block_tables(seq)):
            live = sum(b >= 0 for b in table)
            key = f"{type(g.spec).__name__}:{getattr(g.spec, 'compress_rate', '')}"
            used.setdefault(key, []).append(live)
            if isinstance(g.spec, CompressedSpec):
                assert live == g.spec.blocks_needed(seq.num_computed_tokens)
    assert set(used["StateSpec:"]) == {1}
    assert max(used["SharedKVSlidingSpec:"]) <= -(-(12 - 1 + 32) // 8) + 1  # window + chunk, not the length
    assert used["CompressedSpec:4"][-1] == -(-(79 // 4) // 8) and used["CompressedSpec:8"][-1] == -(
        -(79 // 8) // 8
    )
    assert kv.bytes_in_use == 0


# ----- accounting -------------------------------------------------------------------------------------
def test_spec_counts_match_transformers_and_the_cache(ckpt, hf):
    spec = load_model_spec(ckpt)
    assert spec.params == sum(p.numel() for p in hf.parameters())
    states = [s for s in layer_specs(spec, 8, torch.float32) if isinstance(s, StateSpec)]
    assert spec.state_bytes_per_sequence(4) == sum(s.page_bytes_per_layer for s in states)
    # what the cache grows by per token: CSA entries (32 + 16 values) every 4 tokens
    # in two layers, HCA every 8
    assert spec.kv_bytes_per_token(2) == (2 * 48 / 4 + 32 / 8) * 2


def test_roofline_ops_and_kv_growth(ckpt):
    """Decode at two contexts: the KV read grows by the HCA entries and the CSA index keys only (the
    window is bounded, the CSA layers read at most index_topk entries)."""
    from forwardpass.analysis.roofline import analyze

    spec = load_model_spec(ckpt)
    short, long = (
        analyze(spec, "h100", prefill_tokens=64, context=c, batches=(1, 4), kv_dtype="bf16")
        for c in (4096, 65536)
    )
    names = {o.name for o in short.decode[0].ops}
    assert {"swa.attn_scores", "csa.indexer.scores", "hca.compressor.pool", "hc_attn.mix"} <= names
    grow = long.decode[0].total.kv_read_bytes - short.decode[0].total.kv_read_bytes
    entries = lambda m: 65536 // m - 4096 // m
    assert grow == pytest.approx((2 * entries(4) * 16 + entries(8) * 32) * 2)
    assert long.decode[1].total.kv_read_bytes == pytest.approx(4 * long.decode[0].total.kv_read_bytes)


def test_compressed_curve_uses_the_model(ckpt):
    from forwardpass.analysis.state import compressed_decode_cost, mixer_cost_vs_context

    spec = load_model_spec(ckpt)
    cost = mixer_cost_vs_context(64, [4096, 1 << 20], model=spec)
    rows = cost["compressed"]
    # per layer on average: window 12 + (HCA) L/8 entries of 32 values; CSA: L/4 index keys of 16 + 3 entries
    expected = (4 * 12 * 32 + (1 << 20) // 8 * 32 + 2 * ((1 << 20) // 4 * 16 + 3 * 32)) * 2 / 4
    assert rows[1]["bytes"] == expected == compressed_decode_cost(spec, 1 << 20)[1]
    assert rows[1]["bytes"] < cost["softmax"][1]["bytes"] / 20  # L / m of narrow keys, not L of K and V


@pytest.mark.slow
def test_preset_counts_the_full_size_model():
    """transformers' default DeepseekV4Config (V4-Flash sizes), built on the meta device: same count."""
    import transformers

    from forwardpass.analysis.roofline import resolve_spec

    with torch.device("meta"):
        model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config())
    assert resolve_spec("deepseek-v4").params == sum(p.numel() for p in model.parameters())


# ----- configs refused at load ------------------------------------------------------------------------
BASE = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "head_dim": 32,
    "vocab_size": 512,
    "q_lora_rank": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "o_groups": 2,
    "index_head_dim": 16,
    "partial_rotary_factor": 0.5,
}


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"o_groups": 3}, "o_groups"),
        (
            {"partial_rotary_factor": 0.75},
            "partial_rotary_factor",
        ),  # 24 rotary channels do not fit index_head_dim 16
    ],
)
def test_unsupported_configs_are_refused(extra, param):
    ModelSpec.from_config(BASE)  # the base itself loads
    with pytest.raises(ForwardpassError) as err:
        ModelSpec.from_config({**BASE, **extra})
    assert err.value.param == param


def test_packed_weights_match_transformers(tmp_path):
    """A model wide enough for packed fp32 weights (whole 64-row panels) on the compiled CPU path: the plan
    packs its projections and keeps the grouped ``wo_a`` plain (read as a matrix), and greedy decoding equals
    transformers'. (Packing used to replace ``wo_a``'s weight after the model was built: its first step
    failed on ``.view``.)"""
    from forwardpass.attention import cpu_kernel
    from forwardpass.layers.packed import PackedWeight

    if cpu_kernel.load_paged_decode() is None:
        pytest.skip("no C++ toolchain: no packed weights")
    path = make_deepseek_v4_checkpoint(tmp_path / "wide", hidden_size=128, q_lora_rank=64, o_lora_rank=32)
    llm = _llm(path, cpu_kernels=True)
    attn = llm.engine.model.model.layers[0].attn
    assert isinstance(attn.wq_b.weight, PackedWeight) and isinstance(attn.wo_b.weight, PackedWeight)
    assert isinstance(attn.wo_a.weight, torch.nn.Parameter) and attn.wo_a.role == "dense"
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    hf = hf_model(path)
    assert got == [hf_greedy(hf, p, 16) for p in PROMPTS]
    llm.engine.check_invariants()
