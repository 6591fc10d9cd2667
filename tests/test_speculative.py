"""Speculative decoding (ngram) is lossless: the same greedy tokens with and without it, for every cache
kind that can roll back, alone, in mixed batches, under preemption; and it really speculates (drafts
proposed, some accepted, some rejected). Models whose cache cannot roll back refuse it at build time."""

from __future__ import annotations

import pytest
import torch

from forwardpass import LLM, SamplingParams
from forwardpass.config import EngineConfig, SpeculativeConfig
from forwardpass.errors import ConfigError
from tests.helpers.checkpoints import random_prompts

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
# always propose, from a single recurring token on: the adaptive policy would (rightly) stop proposing on
# a random-weight model, whose text rarely repeats
ALWAYS = {**NGRAM, "prompt_lookup_min": 1, "adaptive": False, "disable_by_batch_size": None}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def copy_heavy_prompts(n: int = 6, vocab: int = 512) -> list[list[int]]:
    """Repeated token patterns (the n-grams recur, so drafts are proposed) mixed with random text."""
    out = []
    for i in range(n):
        pattern = random_prompts(1, [3 + i % 4], vocab=vocab, seed=50 + i)[0]
        noise = random_prompts(1, [5 + 3 * i], vocab=vocab, seed=80 + i)[0]
        out.append(noise + pattern * (4 + i % 3) + noise[:3])
    return out


def make(variant, tmp_path_factory, checkpoint_factory):
    if variant in ("llama", "qwen3", "mistral"):
        return checkpoint_factory(variant)
    if variant == "qwen3_moe":
        from tests.helpers.moe_checkpoints import make_moe_checkpoint

        return make_moe_checkpoint(tmp_path_factory.mktemp("moe"), "qwen3_moe_k2_norm")
    from tests.helpers.attention_checkpoints import make_attention_checkpoint

    return make_attention_checkpoint(tmp_path_factory.mktemp("mla"), "deepseek_v3")


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def spec_counts(outs) -> tuple[int, int]:
    return sum(o.metrics.num_draft_tokens for o in outs), sum(o.metrics.num_accepted_tokens for o in outs)


def all_blocks_free(llm: LLM) -> None:
    llm.engine.check_invariants()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.parametrize("variant", ["llama", "qwen3", "qwen3_moe", "mistral", "deepseek_v3"])
def test_greedy_is_lossless(variant, tmp_path_factory, checkpoint_factory):
    path = make(variant, tmp_path_factory, checkpoint_factory)
    prompts = copy_heavy_prompts(4) + random_prompts(1, [45], seed=3)
    ref_llm = LLM(path, num_kv_blocks=128)
    reference = token_ids(ref_llm.generate(prompts, GREEDY, use_tqdm=False))

    # alone: one sequence at a time, every step a verify of its drafts (or a plain decode step)
    alone = LLM(path, num_kv_blocks=128, max_num_seqs=1, speculative_config=ALWAYS)
    outs = alone.generate(prompts[:3], GREEDY, use_tqdm=False)
    assert token_ids(outs) == reference[:3]
    drafts, accepted = spec_counts(outs)
    assert 0 < accepted < drafts, (drafts, accepted)  # proposed, accepted and rejected
    all_blocks_free(alone)

    # mixed batches: verifying sequences next to plain decode rows and newcomers' prefill chunks in one
    # forward pass (3 batch slots for 6 requests: later ones are admitted while the first ones speculate)
    mixed = LLM(path, num_kv_blocks=128, max_num_seqs=3, max_num_batched_tokens=24, speculative_config=ALWAYS)
    outs = mixed.generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(outs) == reference
    steps = list(mixed.engine.stats)
    assert any(r.acceptance_lengths and len(r.acceptance_lengths) < r.num_seqs_scheduled for r in steps)
    assert any(r.acceptance_lengths and r.num_prefill_tokens for r in steps)
    assert sum(r.num_accepted_tokens for r in steps) == spec_counts(outs)[1] > 0
    all_blocks_free(mixed)

    # preemption: a KV cache far too small for the batch, so speculating sequences are preempted
    tiny = LLM(path, num_kv_blocks=14, max_model_len=96, speculative_config=ALWAYS)
    outs = tiny.generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(outs) == reference
    assert tiny.engine.core.scheduler.num_preemptions > 0
    assert any(o.metrics.num_preemptions and o.metrics.num_draft_tokens for o in outs)  # preempted drafters
    assert spec_counts(outs)[1] > 0
    all_blocks_free(tiny)


@pytest.fixture(scope="module")
def qwen3(checkpoint_factory):
    return checkpoint_factory("qwen3")


def test_stops_inside_an_accepted_run_cut_it(qwen3):
    """max_tokens, a stop token and EOS reached inside a run of accepted drafts end the output exactly
    where decoding without speculation ends it."""
    prompts = copy_heavy_prompts()
    base, spec = LLM(qwen3, num_kv_blocks=128), LLM(qwen3, num_kv_blocks=128, speculative_config=ALWAYS)
    full = token_ids(base.generate(prompts, GREEDY, use_tqdm=False))
    stops = [[t for t in out[5:] if t != out[0]][:1] for out in full]  # a token first seen mid-output
    cases = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (1, 2, 7, 13)]
    cases += [SamplingParams(temperature=0, max_tokens=40, stop_token_ids=s) for s in stops]
    for params in cases:
        ps = [params] * len(prompts) if params.stop_token_ids is None else cases[4:]
        want = base.generate(prompts, ps, use_tqdm=False)
        got = spec.generate(prompts, ps, use_tqdm=False)
        assert token_ids(got) == token_ids(want)
        assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in want]
        assert [o.outputs[0].stop_reason for o in got] == [o.outputs[0].stop_reason for o in want]
    assert spec_counts(spec.generate(prompts, GREEDY, use_tqdm=False))[1] > 0
    all_blocks_free(spec)


def test_logprobs_n_and_seeded_sampling_match(qwen3):
    """Logprobs per emitted token; n > 1; a seeded request at temperature > 0 draws the same tokens (the
    verify consumes its generator as decoding does); prefix caching on."""
    prompts = copy_heavy_prompts(4)
    base, spec = LLM(qwen3, num_kv_blocks=128), LLM(qwen3, num_kv_blocks=128, speculative_config=ALWAYS)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.8, top_p=0.95, max_tokens=30, ignore_eos=True, seed=7, n=3),
              SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True, seed=11,
                             repetition_penalty=1.2)]
    for p in params:
        want = base.generate(prompts + prompts[:1], p, use_tqdm=False)  # the repeat hits the prefix cache
        got = spec.generate(prompts + prompts[:1], p, use_tqdm=False)
        for w, g in zip(want, got):
            assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
            if p.logprobs:
                for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
                    assert list(lw) == list(lg)
                    assert [v.logprob for v in lw.values()] == pytest.approx([v.logprob for v in lg.values()],
                                                                            abs=1e-4)
    assert spec.engine.kv.prefix_hits > 0
    all_blocks_free(spec)


def test_stop_strings_cut_a_multi_token_step(tmp_path, checkpoint_factory):
    from tests.helpers.moe_checkpoints import copy_with_tokenizer

    path = copy_with_tokenizer(checkpoint_factory("qwen3"), tmp_path / "tok")
    base, spec = LLM(path, num_kv_blocks=128), LLM(path, num_kv_blocks=128, speculative_config=ALWAYS)
    prompts = copy_heavy_prompts(4)
    full = base.generate(prompts, GREEDY, use_tqdm=False)
    checked = 0
    for out, prompt in zip(full, prompts):
        text = out.outputs[0].text
        if len(text) < 12:
            continue
        checked += 1
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
        want = base.generate([prompt], p, use_tqdm=False)[0].outputs[0]
        got = spec.generate([prompt], p, use_tqdm=False)[0].outputs[0]
        assert (got.text, got.token_ids) == (want.text, want.token_ids)
        assert got.finish_reason == "stop" and got.stop_reason == stop
    assert checked >= 2
    assert spec_counts(spec.generate(prompts, GREEDY, use_tqdm=False))[1] > 0
    all_blocks_free(spec)


def test_adaptive_policy_stops_proposing_when_drafts_fail(qwen3):
    """Random text: drafts are rare and mostly rejected, so the adaptive policy proposes far fewer than
    speculation without it (and the output is unchanged)."""
    prompts = random_prompts(4, [40], seed=9)
    params = SamplingParams(temperature=1.0, max_tokens=60, ignore_eos=True, seed=1)
    always = LLM(qwen3, num_kv_blocks=128, speculative_config=ALWAYS)
    adaptive = LLM(qwen3, num_kv_blocks=128, speculative_config=NGRAM)
    a = always.generate(prompts, params, use_tqdm=False)
    b = adaptive.generate(prompts, params, use_tqdm=False)
    assert token_ids(a) == token_ids(b)
    (da, aa), (db, _) = spec_counts(a), spec_counts(b)
    assert aa < 0.5 * da, (da, aa)  # the premise: most drafts are rejected here
    assert db < 0.5 * da, (db, da)


def test_large_batches_do_not_speculate(qwen3):
    """Above disable_by_batch_size running sequences nobody proposes; once the batch shrinks they do."""
    prompts = copy_heavy_prompts(6)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (4, 4, 4, 30, 30, 30)]
    llm = LLM(qwen3, num_kv_blocks=128, speculative_config={**ALWAYS, "disable_by_batch_size": 3})
    llm.generate(prompts, params, use_tqdm=False)
    steps = list(llm.engine.stats)
    assert any(r.num_seqs_scheduled > 3 for r in steps)
    assert all(not r.num_draft_tokens for r in steps if r.num_seqs_scheduled > 3)
    assert any(r.num_draft_tokens for r in steps)  # once the batch shrank


def test_models_that_cannot_roll_back_refuse(tmp_path):
    from tests.helpers.state_checkpoints import make_state_checkpoint

    path = make_state_checkpoint(tmp_path / "m", "mamba2")
    with pytest.raises(ConfigError, match="rolled back.*recurrent state") as err:
        LLM(path, num_kv_blocks=16, speculative_config=NGRAM)
    assert err.value.param == "speculative_config"


@pytest.mark.parametrize("bad, field", [
    ({"method": "eagle"}, "method"), ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min"), ({"lookahead": 2}, "lookahead"),
    ({"disable_by_batch_size": 0}, "disable_by_batch_size"),
])
def test_config_errors_name_the_field(bad, field):
    with pytest.raises(ConfigError) as err:
        EngineConfig(speculative_config=bad)
    assert err.value.param == f"speculative_config.{field}"
    assert EngineConfig(speculative_config=NGRAM).speculative_config == SpeculativeConfig(**NGRAM)


def test_ngram_proposer():
    from forwardpass.engine.speculative.ngram import NgramProposer

    p = NgramProposer(2, 4)
    assert p.propose([1, 2, 3, 4, 5, 1, 2, 3], 3) == (4, 5, 1)  # the longest n-gram (1 2 3) recurs
    assert p.propose([1, 2, 3, 4, 5, 6], 3) == ()
    assert p.propose([9, 1, 2, 8, 1, 2, 7, 3, 1, 2], 2) == (7, 3)  # the most recent occurrence
    assert p.propose([1, 2, 3, 1, 2, 3, 1, 2], 5) == (3, 1, 2, 3, 1)  # a loop continues past the end
    assert torch.tensor(p.propose([7] * 6, 4)).eq(7).all()


def test_ngram_proposer_against_a_plain_loop():
    """The byte search (``bytes.rfind`` over 8-byte ids, matches only at token boundaries) finds what a plain
    loop over the windows finds, on random sequences over small and large vocabularies — with ids such as 256
    and 65536, whose bytes next to a 0 hold those of 1 off the token boundaries."""
    import random

    from forwardpass.engine.speculative.ngram import NgramProposer

    def plain(t, lo, hi, k):
        for n in range(min(hi, len(t) - 1), lo - 1, -1):
            for i in range(len(t) - 1 - n, -1, -1):  # most recent first, ending before the suffix
                if t[i : i + n] == t[len(t) - n :]:
                    drafts = list(t[i + n : i + n + k])
                    while len(drafts) < k:
                        drafts.append(drafts[len(drafts) - (len(t) - i - n)])
                    return tuple(drafts), n
        return (), 0

    rng = random.Random(0)
    for _ in range(2000):
        vocab = rng.choice([[0, 1], [0, 1, 2], list(range(300)), [0, 1, 256, 65536, 2**40]])
        t = [rng.choice(vocab) for _ in range(rng.randint(0, 50))]
        lo = rng.randint(1, 3)
        hi, k = rng.randint(lo, 5), rng.randint(1, 9)
        want = plain(t, lo, hi, k) if len(t) > lo else ((), 0)
        assert NgramProposer(lo, hi).match(t, k) == want, (t, lo, hi, k)
    # the bytes of 256, 0 hold those of 1 one byte in: no match
    assert NgramProposer(1, 1).match([256, 0, 5, 1], 2) == ((), 0)


def test_server_flag_and_metrics(checkpoint_factory, tmp_path):
    """``serve --speculative-config JSON``; /metrics counts drafts and accepted tokens (vLLM's names)."""
    import json

    import httpx

    from tests.helpers.server import ServerProcess, make_served_model

    model = make_served_model(tmp_path / "served", checkpoint_factory("qwen3"))
    with ServerProcess(model, "--num-kv-blocks", "64", "--speculative-config", json.dumps(ALWAYS)) as srv:
        body = {"model": "test-model", "prompt": "one two three one two three one two", "max_tokens": 40,
                "temperature": 0, "ignore_eos": True}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        text = httpx.get(srv.url + "/metrics", timeout=30).text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(("vllm:spec_decode", "forwardpass:spec_decode")) and "_bucket" not in line}
    drafts = values["vllm:spec_decode_num_draft_tokens_total"]
    assert drafts == values["forwardpass:spec_decode_num_draft_tokens_total"] > 0
    assert 0 < values["vllm:spec_decode_num_accepted_tokens_total"] <= drafts
    assert values["forwardpass:spec_decode_acceptance_length_count"] > 0
