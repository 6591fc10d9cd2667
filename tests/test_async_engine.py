"""AsyncLLMEngine: streamed outputs equal the offline API's, cancellation frees KV blocks, faults fail
requests instead of hanging, the queue bound, shutdown. Thread backend (fast); one process-backend run."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from forwardpass import LLM, SamplingParams
from forwardpass.engine.core import EngineCore
from forwardpass.engine.frontend.async_engine import AsyncLLMEngine, EngineSpec
from forwardpass.errors import EngineDeadError, ForwardpassError, QueueFullError, ValidationError
from tests.helpers.checkpoints import random_prompts

pytestmark = pytest.mark.timeout(120)
ENGINE_KW = {"num_kv_blocks": 96, "block_size": 16, "max_num_seqs": 16}


@pytest.fixture(scope="module")
def ckpt(checkpoint_factory):
    return checkpoint_factory("qwen3")


@pytest.fixture(scope="module", autouse=True)
def one_compute_thread():
    """On 2 shared, busy cores two OpenMP threads make a tiny model's step ~15x slower."""
    import os

    import torch

    before, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # for the engine process
    yield
    torch.set_num_threads(before)
    if env is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = env


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 100))


async def started(ckpt, backend="thread", factory=None, **kw):
    engine = AsyncLLMEngine(EngineSpec(str(ckpt), {**ENGINE_KW, **kw.pop("config", {})}, factory=factory),
                            backend=backend, **kw)
    await engine.start()
    return engine


async def final(engine, prompt, params, rid):
    outs = [o async for o in engine.generate(prompt, params, rid)]
    assert outs and outs[-1].finished and all(not o.finished for o in outs[:-1])
    # cumulative: every output extends the previous one
    for a, b in itertools.pairwise(outs):
        assert b.outputs[0].token_ids[: len(a.outputs[0].token_ids)] == a.outputs[0].token_ids
    return outs[-1]


async def assert_all_free(engine):
    info = await engine.debug_info()
    assert info["invariants_ok"], info["invariant_error"]
    assert info["num_free_blocks"] == info["num_blocks"] and info["num_requests"] == 0, info


# ----- engine factories (module level: the process backend pickles them) -----------------------------
class SlowEngine(EngineCore):
    def step(self):
        time.sleep(0.3)
        return super().step()


class FaultyStepEngine(EngineCore):
    """The 3rd step raises; afterwards the engine works."""

    def step(self):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 3:
            raise RuntimeError("injected step fault")
        return super().step()


class BrokenEngine(EngineCore):
    """Every step raises and the invariant check fails: the loop must die, not hang."""

    def step(self):
        raise RuntimeError("injected step fault")

    def check_invariants(self):
        raise AssertionError("injected broken KV pool")


# ----- tests ----------------------------------------------------------------------------------------
def test_streamed_greedy_equals_llm_generate(ckpt):
    prompts = random_prompts(6, [5, 40, 17, 70], seed=3)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids
                for o in LLM(ckpt, **ENGINE_KW).generate(prompts, params, use_tqdm=False)]

    async def main():
        engine = await started(ckpt)
        outs = await asyncio.gather(*(final(engine, p, params, f"r{i}") for i, p in enumerate(prompts)))
        await assert_all_free(engine)
        await engine.shutdown(5)
        return outs

    outs = run(main())
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert outs[0].prompt_token_ids == prompts[0]


def test_streamed_text_equals_llm_generate_with_stop_strings(ckpt, tmp_path):
    from tests.helpers.server import make_served_model

    model = make_served_model(tmp_path / "m", ckpt)
    llm = LLM(model, **ENGINE_KW)
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    text = llm.generate("Once upon a time", plain, use_tqdm=False)[0].outputs[0].text
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    cases = [("Once upon a time", plain), ("Once upon a time", plain.replace(stop=[stop])),
             ("The quick brown fox", SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=20,
                                                    ignore_eos=True))]
    expected = [[c.text for c in llm.generate(p, sp, use_tqdm=False)[0].outputs] for p, sp in cases]

    async def main():
        engine = await started(model)
        outs = await asyncio.gather(*(final(engine, p, sp, f"t{i}") for i, (p, sp) in enumerate(cases)))
        await engine.shutdown(5)
        return [[c.text for c in o.outputs] for o in outs]

    got = run(main())
    assert got == expected
    assert got[1][0] == text[: text.find(stop)]


def test_n_and_logprobs_are_accumulated(ckpt):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=9, ignore_eos=True, logprobs=2)

    async def main():
        engine = await started(ckpt)
        out = await final(engine, random_prompts(1, [11])[0], params, "n3")
        await engine.shutdown(5)
        return out

    out = run(main())
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for c in out.outputs:
        assert len(c.token_ids) == 9 and len(c.logprobs) == 9
        assert all(c.token_ids[i] in c.logprobs[i] for i in range(9))


def test_closing_the_generator_aborts_and_frees_blocks(ckpt):
    async def main():
        engine = await started(ckpt)
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        gen = engine.generate(random_prompts(1, [60])[0], params, "long")
        first = await gen.__anext__()
        assert not first.finished
        await gen.aclose()
        # a consumer cancelled while waiting for its next output: cancelled as soon as its first output is in
        # (a fixed sleep raced the engine: a tiny model's 400 tokens can take under 0.3 s)
        streaming = asyncio.Event()

        async def consume():
            async for _ in engine.generate(random_prompts(1, [30])[0], params, "cancelled"):
                streaming.set()

        task = asyncio.ensure_future(consume())
        await streaming.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await assert_all_free(engine)
        assert engine.num_unfinished == 0
        await engine.shutdown(5)

    run(main())


def test_many_concurrent_requests(ckpt):
    prompts = random_prompts(40, [3, 9, 25, 33], seed=5)

    async def main():
        engine = await started(ckpt)
        params = SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True)
        outs = await asyncio.gather(*(final(engine, p, params, f"c{i}") for i, p in enumerate(prompts)))
        await assert_all_free(engine)
        await engine.shutdown(5)
        return outs

    outs = run(main())
    assert len(outs) == 40 and all(len(o.outputs[0].token_ids) == 6 for o in outs)


def test_validation_error_is_raised_before_any_output(ckpt):
    async def main():
        engine = await started(ckpt, config={"max_model_len": 64})
        with pytest.raises(ValidationError, match="maximum context length is 64"):
            await engine.add_request(list(range(3, 80)), SamplingParams(), "too-long")
        with pytest.raises(ValidationError, match="already in use"):
            s = await engine.add_request([5, 6], SamplingParams(max_tokens=2), "dup")
            await engine.add_request([5, 6], SamplingParams(max_tokens=2), "dup")
        s.close()
        await assert_all_free(engine)
        await engine.shutdown(5)

    run(main())


def test_queue_bound_raises_queue_full(ckpt):
    async def main():
        engine = await started(ckpt, factory=SlowEngine, max_queued_requests=2)
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        first = [asyncio.ensure_future(final(engine, [5, 6, 7], params, f"q{i}")) for i in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(QueueFullError):
            await engine.add_request([5, 6, 7], params, "q-over")
        await asyncio.gather(*first)
        out = await final(engine, [5, 6, 7], params, "q-after")  # room again
        assert out.finished
        await engine.shutdown(5)

    run(main())


def test_step_fault_fails_the_requests_and_the_engine_recovers(ckpt):
    async def main():
        engine = await started(ckpt, factory=FaultyStepEngine)
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        with pytest.raises(ForwardpassError, match="injected step fault"):
            await final(engine, [5, 6, 7], params, "victim")
        assert not engine.is_dead
        await assert_all_free(engine)
        out = await final(engine, [5, 6, 7], params, "after")
        assert len(out.outputs[0].token_ids) == 20
        await engine.shutdown(5)

    run(main())


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_loop_crash_marks_the_engine_dead(ckpt, backend):
    async def main():
        engine = await started(ckpt, backend=backend, factory=BrokenEngine)
        with pytest.raises(ForwardpassError, match="injected step fault"):
            await final(engine, [5, 6, 7], SamplingParams(max_tokens=4), "victim")
        for _ in range(100):
            if engine.is_dead:
                break
            await asyncio.sleep(0.05)
        assert engine.is_dead
        with pytest.raises(EngineDeadError):
            await engine.add_request([5, 6], SamplingParams(), "late")
        await engine.shutdown(5)

    run(main())


def test_graceful_shutdown_lets_running_requests_finish(ckpt):
    async def main():
        engine = await started(ckpt)
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        task = asyncio.ensure_future(final(engine, [5, 6, 7], params, "inflight"))
        await asyncio.sleep(0.05)
        await engine.shutdown(timeout=60)
        out = await task
        assert len(out.outputs[0].token_ids) == 30
        with pytest.raises(EngineDeadError):
            await engine.add_request([5, 6], params, "after-shutdown")

    run(main())


def test_process_backend_matches_thread_backend(ckpt):
    prompts = random_prompts(3, [7, 30], seed=9)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)

    async def main(backend):
        engine = await started(ckpt, backend=backend)
        outs = await asyncio.gather(*(final(engine, p, params, f"p{i}") for i, p in enumerate(prompts)))
        await assert_all_free(engine)
        await engine.shutdown(10)
        return [(o.outputs[0].token_ids, [sorted(d) for d in o.outputs[0].logprobs]) for o in outs]

    assert run(main("process")) == run(main("thread"))
