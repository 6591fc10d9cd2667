"""Parity with Hugging Face transformers on tiny random-weight checkpoints (the oracle)."""

from __future__ import annotations

import pytest
import torch

from forwardpass import LLM, SamplingParams
from tests.helpers.checkpoints import VARIANTS, random_prompts
from tests.helpers.oracle import hf_greedy, hf_model

transformers = pytest.importorskip("transformers")

PROMPT_LENGTHS = [70, 9, 33, 97]  # includes prompts longer than 64 tokens and than the mistral window


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, checkpoint_factory):
    path = checkpoint_factory(request.param)
    return request.param, path, LLM(path, num_kv_blocks=128, block_size=16)


def test_greedy_matches_transformers(variant):
    name, path, llm = variant
    hf = hf_model(path)
    prompts = random_prompts(2, [PROMPT_LENGTHS[0], PROMPT_LENGTHS[3]], seed=1)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 32), name
        assert out.outputs[0].finish_reason == "length"
    llm.engine.check_invariants()


def test_prefill_logits_match_transformers(variant):
    name, path, llm = variant
    hf = hf_model(path)
    prompt = random_prompts(1, [PROMPT_LENGTHS[3]], seed=2)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
        ours = llm.engine.model.compute_logits(llm.engine.model(torch.tensor(prompt),
                                                                torch.arange(len(prompt))))
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    # The engine's own path (paged KV cache, chunked prefill) on the last position, via logprobs.
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=20), use_tqdm=False)[0]
    ref_lp = torch.log_softmax(ref[-1], -1)
    for tid, lp in out.outputs[0].logprobs[0].items():
        assert abs(lp.logprob - ref_lp[tid].item()) < 1e-4, name


def test_batch_equals_each_alone(variant):
    name, _path, llm = variant
    prompts = random_prompts(4, PROMPT_LENGTHS, seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert together == alone, name
    llm.engine.check_invariants()


def test_chunked_prefill_equals_whole(checkpoint_factory):
    path = checkpoint_factory("llama")
    prompts = random_prompts(6, PROMPT_LENGTHS, seed=4)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    whole = LLM(path, num_kv_blocks=128, max_num_batched_tokens=4096).generate(prompts, params,
                                                                                use_tqdm=False)
    small = LLM(path, num_kv_blocks=128, max_num_batched_tokens=7)
    chunked = small.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in whole] == [o.outputs[0].token_ids for o in chunked]
    small.engine.check_invariants()


def test_naive_backend_matches_sdpa(checkpoint_factory):
    path = checkpoint_factory("qwen3")
    prompts = random_prompts(3, PROMPT_LENGTHS, seed=5)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    a = LLM(path, num_kv_blocks=64, attention_backend="naive").generate(prompts, params, use_tqdm=False)
    b = LLM(path, num_kv_blocks=64, attention_backend="sdpa").generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
