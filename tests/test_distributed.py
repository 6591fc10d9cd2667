"""Tensor and expert parallelism on 2 CPU processes (gloo): the oracle is the same engine on one rank
and Hugging Face transformers; faults must fail the engine quickly, never hang it.

Each test starts one 2-rank engine (a spawned worker imports torch: ~5 s on the shared test machine),
so the cases are chosen to cover the layouts once each: Llama untied with GQA (KV heads split),
Qwen2 tied with 1 KV head (replicated on both ranks, q/k/v bias), Qwen3-MoE with experts split
(tensor parallel) and partitioned (expert parallel).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from forwardpass import LLM, SamplingParams
from forwardpass.distributed.executor import WorkerFailedError
from forwardpass.distributed.worker import RUNNER_ENV, WorkerRunner
from tests.helpers.checkpoints import random_prompts
from tests.helpers.oracle import hf_greedy, hf_model

# Greedy tokens must be equal; the sum over ranks changes float32 rounding only, so log-probabilities
# agree to far better than this on these tiny random models (measured: ~1e-6).
LOGPROB_TOL = 1e-4
NEW_TOKENS = 8
# 16 tokens per step: the prompts are chunked. The PyTorch decode path: loading (or rebuilding) the C++
# kernel in every process would cost more than these tests.
ENGINE = {
    "num_kv_blocks": 64,
    "max_num_batched_tokens": 16,
    "distributed_timeout_s": 20,
    "cpu_kernels": False,
}


@pytest.fixture(autouse=True)
def one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)  # each rank: 1 thread (2 ranks on 2 shared cores)
    yield
    torch.set_num_threads(prev)


def close(llm: LLM) -> None:
    llm.engine.core.runner.parallel.close()


def weight_bytes(llm: LLM) -> int:
    return sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())


def generate(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[dict]]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


def prompt_logprobs(llm: LLM, prompt: list[int]) -> list[dict | None]:
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    return llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs


def assert_logprobs_close(a: list[list[dict]], b: list[list[dict]]) -> None:
    for seq_a, seq_b in zip(a, b):
        for tok_a, tok_b in zip(seq_a, seq_b):
            assert tok_a.keys() == tok_b.keys()
            for t in tok_a:
                assert abs(tok_a[t].logprob - tok_b[t].logprob) < LOGPROB_TOL


def check_parity(path, prompts, hf: bool = True, **tp_options) -> LLM:
    """TP=2 greedy tokens equal TP=1's (and HF's), log-probs close, each rank holding
    about half the weights."""
    # a second round whose prompt starts with the first prompt: it is served from the prefix cache
    again = [prompts[0][:20] + [7, 8, 9]]
    ref = LLM(str(path), **{**ENGINE, "distributed_timeout_s": 60})
    ref_tokens, ref_logprobs = generate(ref, prompts)
    ref_again = generate(ref, again)[0]
    ref_prompt_lps = prompt_logprobs(ref, prompts[0])
    total, ref_kv_heads = weight_bytes(ref), ref.engine.core.runner.kv_caches[0].shape[3]
    del ref
    llm = LLM(str(path), tensor_parallel_size=2, **ENGINE, **tp_options)
    tokens, logprobs = generate(llm, prompts)
    assert tokens == ref_tokens
    assert_logprobs_close(logprobs, ref_logprobs)
    assert generate(llm, again)[0] == ref_again and llm.engine.kv.prefix_hits > 0
    # prompt logprobs: more logits computed on rank 0, so more gathers every rank must join
    assert_logprobs_close([prompt_logprobs(llm, prompts[0])[1:]], [ref_prompt_lps[1:]])
    # each rank caches its KV heads only: half of them, or the one it shares when they are replicated
    assert llm.engine.core.runner.kv_caches[0].shape[3] == max(1, ref_kv_heads // 2)
    if hf:
        model = hf_model(path)
        assert [hf_greedy(model, p, NEW_TOKENS) for p in prompts] == tokens
    ranks = [weight_bytes(llm), *llm.engine.core.runner.parallel.worker_weight_bytes.values()]
    assert len(ranks) == 2
    for b in ranks:  # 1/2 of the sharded weights plus the replicated norms (and a replicated KV head)
        assert 0.45 * total < b < 0.6 * total, (b, total)
    check_communication(llm)
    llm.engine.check_invariants()
    return llm


def check_communication(llm: LLM) -> None:
    """The analyzer's all-reduce count and bytes per step are what rank 0 actually sent."""
    from forwardpass.analysis.parallel import step_communication

    predicted = [
        step_communication(
            llm.engine.spec, 2, r.num_prefill_tokens + r.num_decode_tokens, r.num_sampled, dtype_bytes=4
        )
        for r in llm.engine.stats
    ]
    tp = llm.engine.core.runner.parallel.tp
    assert tp.all_reduces == sum(p.all_reduces for p in predicted)
    assert tp.all_reduce_bytes == sum(p.all_reduce_payload for p in predicted)


@pytest.mark.parametrize("variant", ["llama", "qwen2", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_tensor_parallel_matches_one_rank_and_transformers(checkpoint_factory, variant):
    # llama: untied LM head, 4 heads / 2 KV heads (one per rank); qwen2: tied, 1 KV head on both ranks;
    # qwen3: q/k norm, explicit head_dim (Qwen3-MoE below covers both in CI)
    prompts = random_prompts(3, [30, 7, 19], seed=1)  # 30 > 16: chunked prefill; 3 prompts: batched
    close(check_parity(checkpoint_factory(variant), prompts))


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    from tests.helpers.moe_checkpoints import make_moe_checkpoint

    return make_moe_checkpoint(tmp_path_factory.mktemp("moe"), "qwen3_moe_k2_norm")


@pytest.mark.parametrize(
    "expert_parallel",
    [pytest.param(False, marks=pytest.mark.slow), True],
    ids=["experts-split", "expert-parallel"],
)
def test_moe_tensor_and_expert_parallel_match_one_rank(moe_checkpoint, expert_parallel):
    from forwardpass.engine.worker.routing_stats import rank_loads

    prompts = random_prompts(2, [21, 6], seed=2)
    llm = check_parity(moe_checkpoint, prompts, hf=False, enable_expert_parallel=expert_parallel)
    try:
        moe = llm.engine.model.model.layers[0].mlp
        assert moe.experts.gate_up_proj.shape[0] == (4 if expert_parallel else 8)  # 8 experts
        loads = rank_loads(llm.engine.routing_stats, 2)
        tokens = sum(r.num_tokens for r in llm.engine.routing_stats)
        for per_rank in loads.values():  # every assignment (top-2 per token) lands on exactly one rank
            assert sum(per_rank) == 2 * tokens
    finally:
        close(llm)


def test_sizes_that_do_not_split_are_refused_before_any_process_starts(checkpoint_factory):
    from forwardpass.errors import ConfigError

    with pytest.raises(ConfigError, match="must divide the attention heads"):  # 4 heads
        LLM(str(checkpoint_factory("llama")), tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="LoRA"):
        LLM(str(checkpoint_factory("llama")), tensor_parallel_size=2, enable_lora=True)


def test_killed_worker_fails_requests_quickly(checkpoint_factory):
    llm = LLM(str(checkpoint_factory("qwen3")), tensor_parallel_size=2, **ENGINE)
    worker = llm.engine.core.runner.parallel.procs[0]
    generate(llm, random_prompts(1, [5]))
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(5)
    start = time.monotonic()
    with pytest.raises(WorkerFailedError, match="rank 1 exited with code -9"):
        generate(llm, random_prompts(2, [5, 9]))
    assert time.monotonic() - start < 10  # the closed connection is noticed at once, not after a timeout
    with pytest.raises(WorkerFailedError):  # and the engine stays dead
        generate(llm, random_prompts(1, [5]))
    assert llm.engine.get_num_unfinished_requests() == 0  # the failed requests were aborted


class RaisingRunner(WorkerRunner):
    """A worker that fails in its third step (set through the environment in the spawned worker)."""

    steps = 0

    def step(self, msg):
        type(self).steps += 1
        if type(self).steps == 3:
            raise RuntimeError("injected worker fault")
        super().step(msg)


class HangingRunner(WorkerRunner):
    def step(self, msg):
        if not msg.scheduled.is_empty and msg.sampled:
            time.sleep(600)
        super().step(msg)


def test_raising_worker_fails_request_and_health_503(tmp_path, checkpoint_factory):
    import httpx

    from tests.helpers.server import ServerProcess, make_served_model

    model = make_served_model(tmp_path / "m", checkpoint_factory("qwen3"))
    env = {RUNNER_ENV: "tests.test_distributed:RaisingRunner", "FORWARDPASS_CPU_KERNEL": "0"}
    # the engine loop in a thread of the server: one process fewer to start (the worker is spawned either way)
    flags = ("--tensor-parallel-size", "2", "--num-kv-blocks", "64", "--engine-backend", "thread")
    with ServerProcess(model, *flags, env=env) as srv:
        start = time.monotonic()
        r = httpx.post(
            srv.url + "/v1/completions",
            timeout=30,
            json={"model": "test-model", "prompt": "hello", "max_tokens": 8, "temperature": 0},
        )
        assert r.status_code >= 500
        assert "injected worker fault" in r.json()["error"]["message"]
        assert time.monotonic() - start < 15
        health = httpx.get(srv.url + "/health", timeout=5)
        assert health.status_code == 503 and "rank 1" in health.json()["error"]["message"]


@pytest.mark.slow
def test_hung_worker_times_out(checkpoint_factory, monkeypatch):
    monkeypatch.setenv(RUNNER_ENV, "tests.test_distributed:HangingRunner")
    llm = LLM(
        str(checkpoint_factory("qwen3")), tensor_parallel_size=2, **{**ENGINE, "distributed_timeout_s": 3}
    )
    start = time.monotonic()
    with pytest.raises(WorkerFailedError):
        generate(llm, random_prompts(1, [5]))
    assert time.monotonic() - start < 15
