"""Issue 21, engine side: one request must never hurt another (numbered after the issue's breaks).

Server-side checks (HTTP input, templates, symlinks, watchdog, shutdown, noisy neighbour) are in
``tests/test_server_hardening.py``.
"""

from __future__ import annotations

import asyncio

import pytest

from forwardpass import LLM, SamplingParams
from forwardpass.engine.core import EngineCore
from forwardpass.engine.frontend.async_engine import AsyncLLMEngine, EngineSpec
from forwardpass.errors import ForwardpassError, SamplingParamsError, ValidationError
from forwardpass.sampling.sampler import Sampler

pytestmark = pytest.mark.timeout(120)
ENGINE_KW = {"num_kv_blocks": 96, "block_size": 16, "max_num_seqs": 16}
POISON_SEED = 777001  # the sampler raises for this request's row once it has 2 tokens


@pytest.fixture(scope="module")
def ckpt(checkpoint_factory):
    return checkpoint_factory("qwen3")


@pytest.fixture(scope="module", autouse=True)
def one_compute_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class PoisonSampler(Sampler):
    def __call__(self, logits, rows, eos_token_ids=()):
        if any(r.params.seed == POISON_SEED and len(r.output_token_ids) >= 2 for r in rows):
            raise ValueError("injected per-request sampler fault")
        return super().__call__(logits, rows, eos_token_ids)


class PoisonEngine(EngineCore):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.runner.sampler = PoisonSampler()


# ----- break 1: one request's sampling parameters failed every request ------------------------------
def test_break1_huge_top_k_is_a_validation_error_in_the_python_api(ckpt):
    for top_k in (9223372036854775808, 10**30):
        with pytest.raises(SamplingParamsError) as e:
            SamplingParams(temperature=1.0, top_k=top_k)
        assert e.value.param == "top_k"
    llm = LLM(str(ckpt), **ENGINE_KW)
    with pytest.raises(ValidationError) as e:  # within the int64 cap but beyond the vocabulary
        llm.generate([[1, 2, 3]], SamplingParams(temperature=1.0, top_k=10**6, max_tokens=2))
    assert e.value.param == "top_k"
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=1.0, top_k=llm.engine.core.spec.vocab,
                                                   max_tokens=2))
    assert len(out[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize(
    "field,value",
    [("seed", 2**64), ("n", 10**9), ("max_tokens", 2**63), ("min_tokens", 2**63), ("stop_token_ids", [2**63]),
     ("temperature", 1e300), ("repetition_penalty", float("inf")), ("logprobs", 10**30)],
)
def test_break1_every_numeric_field_is_bounded(field, value):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field


def test_break1_a_failing_request_fails_alone_mid_batch(ckpt):
    """A per-request fault injected mid-batch fails that request only; the others finish unchanged."""
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(6)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)

    async def main():
        engine = AsyncLLMEngine(EngineSpec(str(ckpt), ENGINE_KW, factory=PoisonEngine), backend="thread")
        await engine.start()
        try:
            async def collect(prompt, params, rid):
                out = None
                async for last in engine.generate(prompt, params, rid):
                    out = last
                return out.outputs[0].token_ids

            alone = [await collect(p, greedy if i % 2 else seeded, f"alone-{i}")
                     for i, p in enumerate(prompts)]
            poison = SamplingParams(temperature=1.0, seed=POISON_SEED, max_tokens=12, ignore_eos=True)
            tasks = [collect(p, greedy if i % 2 else seeded, f"batch-{i}") for i, p in enumerate(prompts)]
            results = await asyncio.gather(collect([9, 9, 9], poison, "poison"), *tasks,
                                           return_exceptions=True)
            assert isinstance(results[0], ForwardpassError), results[0]
            assert "sampling failed for this request" in str(results[0])
            assert "injected per-request sampler fault" in str(results[0])
            assert list(results[1:]) == alone
            info = await engine.debug_info()
            assert info["invariants_ok"] and info["num_free_blocks"] == info["num_blocks"]
            assert not engine.is_dead
        finally:
            await engine.shutdown(timeout=5)

    asyncio.run(asyncio.wait_for(main(), 100))


# ----- break 5: queue accounting and fairness -------------------------------------------------------
def test_break5_queue_limit_counts_every_sequence(ckpt):
    from forwardpass.errors import QueueFullError

    async def main():
        engine = AsyncLLMEngine(EngineSpec(str(ckpt), ENGINE_KW), backend="thread", max_queued_requests=4)
        await engine.start()
        try:
            with pytest.raises(QueueFullError):
                await engine.add_request([1, 2, 3], SamplingParams(n=5, max_tokens=1), "five")
            stream = await engine.add_request([1, 2, 3], SamplingParams(n=4, max_tokens=1), "four")
            assert engine.num_queued in (0, 4)  # 4 until its first token
            outs = [o async for o in stream]
            assert len(outs[-1].outputs) == 4
            stream.close()
        finally:
            await engine.shutdown(timeout=5)

    asyncio.run(asyncio.wait_for(main(), 100))


async def _newcomer_ttft(ckpt, fair_share_tokens: int, num_streams: int = 64) -> float:
    """TTFT of a 4-token newcomer while ``num_streams`` long streams fill every batch slot."""
    import time

    config = {"num_kv_blocks": 2200, "block_size": 16, "max_num_seqs": num_streams,
              "fair_share_tokens": fair_share_tokens}
    engine = AsyncLLMEngine(EngineSpec(str(ckpt), config), backend="thread")
    await engine.start()
    long = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)
    progress = [0] * num_streams
    streams = [await engine.add_request([7, 8, i % 500], long, f"long-{i}") for i in range(num_streams)]

    async def drain(i, s):
        async for out in s:
            progress[i] = len(out.outputs[0].token_ids)

    tasks = [asyncio.ensure_future(drain(i, s)) for i, s in enumerate(streams)]
    try:
        while min(progress) < 40:  # every slot is a long stream past its fair share
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        newcomer = await engine.add_request([3, 4, 5, 6], SamplingParams(temperature=0.0, max_tokens=4),
                                            "new")
        async for _ in newcomer:
            break
        ttft = time.monotonic() - t0
        newcomer.close()
        return ttft
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.close()
        await engine.shutdown(timeout=5)


NEWCOMER_TTFT_BOUND_S = 2.0


def test_break5_newcomer_ttft_under_64_long_streams(ckpt):
    """With 64 long streams in all 64 slots a newcomer's first token comes within 2 s (one swap, one
    prefill step). Before the fairness rule it waited for a stream to end (~440 more steps here)."""
    ttft = asyncio.run(asyncio.wait_for(_newcomer_ttft(ckpt, fair_share_tokens=32), 100))
    print(f"newcomer TTFT under 64 long streams: {ttft:.3f} s")
    assert ttft < NEWCOMER_TTFT_BOUND_S


@pytest.mark.slow
def test_break5_newcomer_ttft_without_fairness_for_comparison(ckpt):
    ttft = asyncio.run(asyncio.wait_for(_newcomer_ttft(ckpt, fair_share_tokens=0), 300))
    print(f"newcomer TTFT under 64 long streams, fairness off: {ttft:.3f} s")
    assert ttft > NEWCOMER_TTFT_BOUND_S


def test_break5_swapped_streams_finish_identical(ckpt):
    """Streams swapped out for newcomers and resumed give the tokens they give alone (greedy)."""
    kw = {"num_kv_blocks": 200, "block_size": 16, "max_num_seqs": 2}
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    prompts = [[11 + i, 12, 13, 14 + i] for i in range(6)]
    alone = [o.outputs[0].token_ids
             for o in LLM(str(ckpt), **kw, fair_share_tokens=0).generate(prompts, greedy)]
    llm = LLM(str(ckpt), **kw, fair_share_tokens=8)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert llm.engine.core.scheduler.num_swaps > 0
    assert out == alone


def test_break5_fairness_also_when_the_kv_cache_is_full(ckpt):
    """Two long streams hold the KV cache (free slots, no free blocks): a newcomer whose prompt does not
    fit gets a stream swapped out for it at once, instead of waiting for one to finish; tokens unchanged."""
    kw = {"num_kv_blocks": 20, "block_size": 4, "max_num_seqs": 8}
    streams = SamplingParams(temperature=0.0, max_tokens=36, ignore_eos=True)  # 10 blocks each at the end
    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [[11, 12, 13, 14], [21, 22, 23, 24]]
    newcomer = [(7 * i) % 500 + 3 for i in range(48)]  # 12 blocks: more than the 10 free at step 16
    alone = LLM(str(ckpt), **kw, fair_share_tokens=0)
    expected = [o.outputs[0].token_ids for o in alone.generate(prompts, streams)]
    expected_new = alone.generate([newcomer], short)[0].outputs[0].token_ids

    def run(fair_share_tokens: int) -> tuple[int, dict[str, list[int]]]:
        engine = LLM(str(ckpt), **kw, fair_share_tokens=fair_share_tokens).engine
        for i, p in enumerate(prompts):
            engine.add_request(f"s{i}", p, streams)
        for _ in range(16):
            engine.step()
        engine.add_request("new", newcomer, short)
        steps, first, done = 0, None, {}
        while engine.has_unfinished_requests():
            steps += 1
            for o in engine.step():
                if o.request_id == "new" and first is None and o.outputs[0].token_ids:
                    first = steps
                if o.finished:
                    done[o.request_id] = o.outputs[0].token_ids
        engine.check_invariants()
        return first, done

    first_fair, done = run(fair_share_tokens=8)
    assert first_fair <= 3, first_fair
    assert done == {"s0": expected[0], "s1": expected[1], "new": expected_new}
    first_unfair, _ = run(fair_share_tokens=0)
    assert first_unfair > 15  # without fairness it waits for a stream to finish


# ----- break 8: LoRA patterns cannot backtrack for ever ---------------------------------------------
def test_break8_lora_rank_pattern_regex_is_restricted():
    import time

    from forwardpass.lora.adapter import _pattern_value
    from forwardpass.lora.errors import LoRAAdapterError

    module = "model.layers.0.self_attn." + "a" * 40 + "!"
    t0 = time.monotonic()
    with pytest.raises(LoRAAdapterError, match="quantified groups"):
        _pattern_value({"(a+)+$": 4}, module, 8)
    assert time.monotonic() - t0 < 0.5
    assert _pattern_value({"q_proj": 4}, "model.layers.0.self_attn.q_proj", 8) == 4
    assert _pattern_value({"layers.0.self_attn.q_proj": 2, "v_proj": 4},
                          "model.layers.1.self_attn.q_proj", 8) == 8
    assert _pattern_value({r"layers\.[0-3]\.self_attn\.q_proj": 2}, "model.layers.2.self_attn.q_proj", 8) == 2


def test_break1_a_failing_request_in_the_offline_api_raises_and_leaks_nothing(ckpt):
    llm = LLM(str(ckpt), **ENGINE_KW)
    llm.engine.core.runner.sampler = PoisonSampler()
    poison = SamplingParams(temperature=1.0, seed=POISON_SEED, max_tokens=8, ignore_eos=True)
    with pytest.raises(ForwardpassError, match="sampling failed for this request"):
        llm.generate([[1, 2, 3], [4, 5, 6]], [SamplingParams(max_tokens=8), poison])
    core = llm.engine.core
    assert not core.has_unfinished_requests() and core.kv.num_free_blocks == core.kv.num_blocks
    core.check_invariants()
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3))[0].outputs[0].token_ids) == 3
