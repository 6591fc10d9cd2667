"""``prompt_logprobs``: each prompt token's logprob given the tokens before it, equal to HF transformers'
log-softmax of its own logits, however the engine splits, caches or preempts the prompt."""

from __future__ import annotations

import pytest
import torch

from forwardpass import LLM, SamplingParams
from tests.helpers.checkpoints import random_prompts
from tests.helpers.oracle import hf_model

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def path(checkpoint_factory):
    return checkpoint_factory("qwen3")


@pytest.fixture(scope="module")
def prompts():
    return [random_prompts(1, [n], seed=40 + n)[0] for n in (1, 9, 37, 70)]


@pytest.fixture(scope="module")
def reference(path, prompts):
    """HF's log-softmax at position p, read at prompt token p + 1; and its top 3 token ids."""
    hf = hf_model(path)
    out = []
    with torch.no_grad():
        for p in prompts:
            lp = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1)
            out.append([(lp[i, p[i + 1]].item(), lp[i].topk(3).indices.tolist()) for i in range(len(p) - 1)])
    return out


def check(outs, prompts, reference):
    for out, prompt, ref in zip(outs, prompts, reference):
        got = out.prompt_logprobs
        assert got is not None and len(got) == len(prompt) and got[0] is None
        for pos, (d, (lp, top3)) in enumerate(zip(got[1:], ref), start=1):
            assert abs(d[prompt[pos]].logprob - lp) < 1e-4, pos
            ranked = sorted((v.rank, t) for t, v in d.items() if v.rank is not None and v.rank <= 3)
            assert [t for _, t in ranked] == top3, pos


PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=3)


def test_prompt_logprobs_match_transformers_in_one_batch(path, prompts, reference):
    llm = LLM(path, num_kv_blocks=128)
    check(llm.generate(prompts, PARAMS, use_tqdm=False), prompts, reference)
    llm.engine.check_invariants()


def test_chunked_prefill_and_a_cached_prefix_give_the_same_list(path, prompts, reference):
    """Prompts split into 8-token chunks; then the same prompts again, whose blocks are cached: a request
    asking for prompt logprobs recomputes them instead of skipping the cached positions."""
    llm = LLM(path, num_kv_blocks=128, max_num_batched_tokens=8)
    check(llm.generate(prompts, PARAMS, use_tqdm=False), prompts, reference)
    check(llm.generate(prompts, PARAMS, use_tqdm=False), prompts, reference)
    plain = llm.generate(prompts[-1:], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0  # others still hit the cache
    llm.engine.check_invariants()


def test_preemption_leaves_them_complete_and_once(path, prompts, reference):
    llm = LLM(path, num_kv_blocks=14, max_num_seqs=8, max_model_len=128)
    many = prompts * 3
    outs = llm.generate(many, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                             prompt_logprobs=3),
                        use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    check(outs, many, reference * 3)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_delta_outputs_carry_them_once_cumulative_outputs_always():
    from forwardpass.engine.frontend.output_processor import OutputProcessor
    from forwardpass.engine.scheduling.batch import TokenDelta
    from forwardpass.sampling.sampler import TokenLogprobs

    proc = OutputProcessor(tokenizer=None)
    state = proc.add_request("r", None, [5, 6], SamplingParams(max_tokens=3, prompt_logprobs=0))
    cursor = [(0, 0)]
    first = (None, TokenLogprobs(6, -1.5, 2, []))
    deltas = [TokenDelta("r", 0, (t,), None, prompt_logprobs=first if i == 0 else None)
              for i, t in enumerate((1, 2))]
    streamed = []
    for d in deltas:
        proc.process([d])
        streamed.append(state.make_output(cursor).prompt_logprobs)
    assert streamed[0] == [None, {6: streamed[0][1][6]}] and streamed[0][1][6].logprob == -1.5
    assert streamed[1] is None  # a delta output does not repeat them
    assert state.make_output().prompt_logprobs == streamed[0]  # a cumulative one always has them
