"""Data parallelism: N engine replicas behind one front end, requests to the one with fewest in flight."""

from __future__ import annotations

import asyncio

import pytest

from forwardpass import LLM, SamplingParams
from forwardpass.distributed.data_parallel import DataParallelEngine
from forwardpass.engine.frontend.async_engine import EngineSpec
from forwardpass.errors import EngineDeadError, ValidationError
from tests.helpers.checkpoints import random_prompts

ENGINE = {"num_kv_blocks": 64, "cpu_kernels": False}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_requests_spread_over_replicas_by_load(checkpoint_factory):
    path = checkpoint_factory("qwen3")
    prompts = random_prompts(4, [9, 4, 13], seed=3)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [
        o.outputs[0].token_ids for o in LLM(str(path), **ENGINE).generate(prompts, params, use_tqdm=False)
    ]

    async def main():
        dp = DataParallelEngine(EngineSpec(str(path), ENGINE), replicas=2, backend="thread")
        steps: list[int] = []
        dp.stat_listeners.append(lambda record: steps.append(record.step))  # hears both replicas
        await dp.start()
        try:
            streams = [await dp.add_request(p, params, f"r{i}") for i, p in enumerate(prompts[:4])]
            assert [r.num_unfinished for r in dp.replicas] == [2, 2]  # equal load: they alternate
            streams[1].close()  # replica 1 now has one in flight: the next request goes there, not in turn
            streams[1] = await dp.add_request(prompts[1], params, "r1b")
            assert [r.num_unfinished for r in dp.replicas] == [2, 2]
            streams[0].close()
            streams[2].close()  # replica 0 is idle: both new requests go to it
            streams[0] = await dp.add_request(prompts[0], params, "r0b")
            streams[2] = await dp.add_request(prompts[2], params, "r2b")
            assert [r.num_unfinished for r in dp.replicas] == [2, 2]
            outs = []
            for s in streams:
                last = None
                async for out in s:
                    last = out
                s.close()
                outs.append(last.outputs[0].token_ids)
            assert outs == expected[:4]  # every replica computes the same model
            assert steps and dp.num_unfinished == 0
            with pytest.raises(ValidationError, match="already in use"):
                await _duplicate(dp, params)
        finally:
            await dp.shutdown(timeout=5)
        with pytest.raises(EngineDeadError):
            dp.pick()

    run(main())


def test_one_request_id_sent_twice_at_once_is_accepted_once():
    """Text prompts: each replica awaits its tokenizer before it registers the id, and two requests arriving
    together go to different replicas, so the id is reserved across replicas until one holds it."""
    from forwardpass.assets import default_llm_path

    params = SamplingParams(temperature=0, max_tokens=2)

    async def main():
        dp = DataParallelEngine(EngineSpec(str(default_llm_path()), ENGINE), replicas=2, backend="thread")
        await dp.start()
        try:
            both = await asyncio.gather(*(dp.add_request("It was", params, "twin") for _ in range(2)),
                                        return_exceptions=True)  # fmt: skip
            accepted = [b for b in both if not isinstance(b, BaseException)]
            refused = [b for b in both if isinstance(b, BaseException)]
            assert len(accepted) == 1, both
            assert isinstance(refused[0], ValidationError) and "already in use" in str(refused[0])
            accepted[0].close()
        finally:
            await dp.shutdown(timeout=5)

    run(main())


async def _duplicate(dp: DataParallelEngine, params: SamplingParams):
    stream = await dp.add_request([5, 6, 7], params, "dup")
    try:
        await dp.add_request([5, 6, 7], params, "dup")
    finally:
        stream.close()


@pytest.mark.slow
def test_serve_data_parallel_size_2(tmp_path, checkpoint_factory):
    import concurrent.futures

    import httpx

    from tests.helpers.server import ServerProcess, make_served_model

    model = make_served_model(tmp_path / "m", checkpoint_factory("qwen3"))
    flags = ("--num-kv-blocks", "64", "--data-parallel-size", "2", "--engine-backend", "thread")
    with ServerProcess(model, *flags, env={"FORWARDPASS_CPU_KERNEL": "0"}) as srv:
        body = {"model": "test-model", "prompt": "hello", "max_tokens": 8, "temperature": 0}
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            replies = list(
                pool.map(lambda _: httpx.post(srv.url + "/v1/completions", json=body, timeout=30), range(4))
            )
        assert [r.status_code for r in replies] == [200] * 4
        assert len({r.json()["choices"][0]["text"] for r in replies}) == 1
        state = httpx.get(srv.url + "/dashboard/state", timeout=10).json()
        assert state["kv_blocks_total"] == 128 and state["kv_blocks_used"] == 0  # both replicas' pools
        debug = httpx.get(srv.url + "/debug/engine", timeout=10).json()
        assert len(debug["replicas"]) == 2 and all(r["invariants_ok"] for r in debug["replicas"])
