"""Serving core: continuous batching, chunked prefill, preemption, prefix caching, abort."""

from __future__ import annotations

import pytest
import torch

from forwardpass import LLM, SamplingParams
from forwardpass.errors import ConfigError, ContextLengthError, ValidationError
from tests.helpers.checkpoints import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def path(checkpoint_factory):
    return checkpoint_factory("qwen3", max_position_embeddings=1024)


@pytest.fixture(scope="module")
def prompts64():
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(3, 120, (64,), generator=g).tolist()
    return [random_prompts(1, [n], seed=100 + i)[0] for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def reference(path, prompts64):
    """Each request run on its own: no batching at all."""
    llm = LLM(path, num_kv_blocks=64, max_num_seqs=1)
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts64]
    llm.engine.check_invariants()
    return outs


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_continuous_batching_matches_one_at_a_time(path, prompts64, reference):
    llm = LLM(path, num_kv_blocks=1024, max_num_seqs=64)
    assert tokens(llm.generate(prompts64, GREEDY, use_tqdm=False)) == reference
    assert max(r.num_seqs_scheduled for r in llm.engine.stats) > 16  # really batched
    llm.engine.check_invariants()


def test_chunked_prefill_on_tiny_budget(path, prompts64, reference):
    llm = LLM(path, num_kv_blocks=1024, max_num_seqs=64, max_num_batched_tokens=32)
    assert tokens(llm.generate(prompts64, GREEDY, use_tqdm=False)) == reference
    stats = list(llm.engine.stats)
    assert max(r.num_prefill_tokens + r.num_decode_tokens for r in stats) <= 32
    assert any(r.num_prefill_tokens and r.num_decode_tokens for r in stats)  # mixed steps happened
    llm.engine.check_invariants()


def test_preemption_under_small_kv_budget(path, prompts64, reference):
    # 40 blocks of 16 = 640 tokens: far less than the 64 requests need together.
    llm = LLM(path, num_kv_blocks=40, max_num_seqs=64, max_model_len=256)
    outs = llm.generate(prompts64, GREEDY, use_tqdm=False)
    assert tokens(outs) == reference
    assert all(o.finished for o in outs)
    assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.check_invariants()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_prefix_caching_skips_shared_prefix(path):
    shared = random_prompts(1, [512], seed=11)[0]
    prompts = [shared + random_prompts(1, [5 + i % 7], seed=200 + i)[0] for i in range(32)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    results = {}
    for caching in (False, True):
        llm = LLM(path, num_kv_blocks=512, enable_prefix_caching=caching, max_num_batched_tokens=1024)
        outs = llm.generate(prompts, params, use_tqdm=False)
        computed = sum(r.num_prefill_tokens for r in llm.engine.stats)
        results[caching] = (tokens(outs), computed)
        llm.engine.check_invariants()
    assert results[True][0] == results[False][0]
    off, on = results[False][1], results[True][1]
    assert on <= 0.1 * off, f"prefill tokens computed: {on} with caching vs {off} without"


def test_whole_prompt_cached_still_computes_last_token(path):
    prompt = random_prompts(1, [64], seed=12)[0]  # exactly 4 full blocks
    llm = LLM(path, num_kv_blocks=64)
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    second = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.num_cached_tokens == 48  # the last block is recomputed so its last token has logits
    llm.engine.check_invariants()


def test_abort_half_leaves_others_unchanged(path, prompts64, reference):
    llm = LLM(path, num_kv_blocks=512, max_num_seqs=64)
    engine = llm.engine
    for i, p in enumerate(prompts64[:32]):
        engine.add_request(str(i), p, GREEDY)
    for _ in range(3):
        engine.step()
    engine.abort([str(i) for i in range(0, 32, 2)])
    engine.check_invariants()
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert sorted(done, key=int) == [str(i) for i in range(1, 32, 2)]
    for rid, toks in done.items():
        assert toks == reference[int(rid)]
    engine.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_step_records(path, prompts64):
    llm = LLM(path, num_kv_blocks=256)
    llm.generate(prompts64[:8], GREEDY, use_tqdm=False)
    stats = list(llm.engine.stats)
    assert sum(r.num_decode_tokens for r in stats) == 8 * (GREEDY.max_tokens - 1)
    assert sum(r.num_prefill_tokens for r in stats) == sum(len(p) for p in prompts64[:8])
    assert all(0.0 <= r.kv_usage <= 1.0 for r in stats) and stats[-1].num_running == 0
    assert "prefix_cache_hit_rate" in stats[-1].to_dict()


def test_kv_budget_too_small_is_refused(path):
    with pytest.raises(ConfigError, match="max_model_len"):
        LLM(path, num_kv_blocks=4, max_model_len=512)


def test_prompt_longer_than_context_is_refused(path):
    llm = LLM(path, num_kv_blocks=64, max_model_len=32)
    with pytest.raises(ContextLengthError, match="maximum context length is 32"):
        llm.generate([list(range(3, 40))], GREEDY, use_tqdm=False)
    with pytest.raises(ValidationError, match="token ids"):
        llm.generate([[1, 2, 99999]], GREEDY, use_tqdm=False)
    llm.engine.check_invariants()


def test_generation_stops_at_context_window(path):
    llm = LLM(path, num_kv_blocks=64, max_model_len=40)
    out = llm.generate([list(range(3, 33))], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 10 and out.outputs[0].finish_reason == "length"


def test_step_records_carry_the_analyzers_flops_and_bytes(path):
    """Measured time becomes achieved FLOP/s and GB/s: the FLOPs and bytes attributed to each step
    agree with the roofline analyzer's per-op accounting of the same prefill and decode step."""
    from forwardpass import analyze

    prompt = random_prompts(1, [48], seed=21)[0]
    llm = LLM(path, num_kv_blocks=64, enable_prefix_caching=False)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    prefill, decode = llm.engine.stats[0], llm.engine.stats[1]  # decode: context 49 after the step
    report = analyze(str(path), hardware="h100", prefill_tokens=48, context=49, batches=(1,),
                     weight_dtype="fp32", act_dtype="fp32", kv_dtype="fp32").to_dict()
    assert prefill.flops == pytest.approx(report["prefill"]["flops"], rel=0.05)
    assert decode.flops == pytest.approx(report["decode"][0]["flops"], rel=0.05)
    # the analyzer also counts activation round trips between ops; weights and KV dominate both
    assert decode.bytes == pytest.approx(report["decode"][0]["bytes"], rel=0.15)
    assert decode.achieved_flops_per_s > 0 and decode.to_dict()["achieved_bytes_per_s"] > 0


def test_numerics_fixed_at_construction_whatever_the_timing(path, monkeypatch):
    """Two engines built the same way give bit-identical greedy logprobs over 200 steps, even when the
    compiled decode kernel "finishes building" in the middle of the first run: an engine decides its
    decode path once, when it is built (and every "auto" engine of a process decides the same)."""
    from forwardpass.attention import cpu_kernel

    asked = []

    def kernel_ready_now(wait=True):  # a kernel that would change every result if it were swapped in
        asked.append(wait)
        return lambda q, *args: torch.zeros_like(q)

    prompt = random_prompts(1, [20], seed=5)[0]
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, logprobs=2)

    def run(engine, switch_after=None):
        engine.add_request("r", prompt, params)
        steps, final = 0, None
        while engine.has_unfinished_requests():
            for out in engine.step():
                final = out
            steps += 1
            if steps == switch_after:
                monkeypatch.setattr(cpu_kernel, "load_paged_decode", kernel_ready_now)
        return [[(t, lp.logprob) for t, lp in d.items()] for d in final.outputs[0].logprobs]

    first = run(LLM(path, num_kv_blocks=64, cpu_kernels="auto").engine, switch_after=100)
    second = run(LLM(path, num_kv_blocks=64, cpu_kernels="auto").engine)
    assert len(first) == 200 and first == second  # exact float equality
    assert asked == []  # nobody looked for a kernel mid-run or for the second engine
