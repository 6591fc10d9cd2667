"""A bf16 / fp16 checkpoint's projections kept in their dtype on a float32 CPU engine
(``forwardpass/layers/half_panels.py``, ``layers/csrc/half_panels.h``): the kernel upcasts each weight in
registers, so its result is, bit for bit, the fp32 panel kernel's on the same values (the fp32 path's own
reference, itself checked against float64 in tests/test_packed_weights.py), at every batch size including the
chunked multi-row path that prefill takes; a row's result does not depend on its batch; an engine keeps such a
checkpoint in 2 bytes a weight, reads them from its decode stack too, and generates the tokens the upcast
weights do."""

from __future__ import annotations

import logging

import pytest
import torch

from forwardpass import LLM, SamplingParams
from forwardpass.layers import small_matmul as sm
from forwardpass.layers.half_panels import HalfPanelWeight
from forwardpass.layers.packed import PackedWeight
from forwardpass.layers.weight_report import weight_formats
from tests.helpers.checkpoints import random_prompts
from tests.helpers.isa import builds

ISAS = builds("avx512", {"avx512f"})
HALF = [torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", params=ISAS)
def module(request):
    try:
        return sm.kernel_for(request.param).load(logging.getLogger(__name__))
    except Exception as exc:  # noqa: BLE001 - no compiler here: the engine keeps fp32 weights
        pytest.skip(f"cannot build the kernel: {exc}")


def _rand(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).float()


def _fp32_panels(w):
    n, k = w.shape
    return w.view(n // 64, 64, k).transpose(1, 2).contiguous()


class CountingKernel:
    """The kernel module, counting the rows its small_matmul is called with on half panels."""

    def __init__(self, module):
        self.module, self.rows = module, []

    def small_matmul(self, x, w, bias=None):
        if w.dtype in HALF:
            self.rows.append(x.shape[0])
        return self.module.small_matmul(x, w, bias)


# rows: one (the converting-load path), every tail of the 6-row blocks, past one 64-row work item; K: 1, odd,
# past one 256-k converted chunk
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 64, 65, 130])
@pytest.mark.parametrize("n,k", [(64, 1), (192, 17), (128, 600)])
@pytest.mark.parametrize("bias", [False, True])
def test_half_panels_compute_the_fp32_panels_bits(module, dtype, m, n, k, bias):
    w, x = _rand(n, k, seed=n, dtype=dtype), _rand(m, k, seed=m + 1)
    b = _rand(n, seed=3) if bias else None
    hw = HalfPanelWeight.pack(w, dtype, CountingKernel(module))
    assert hw is not None and hw.panels.dtype == dtype and hw.panels.shape == (n // 64, k, 64)
    got = hw.matmul(x, b)
    assert hw._kernel.rows == [m]  # the half kernel took every row, prefill-sized batches too
    # the fp32 panel kernel, a row at a time: its one-row path sums each output in k order, as ours must
    want = torch.cat([module.small_matmul(x[i : i + 1], _fp32_panels(w), b) for i in range(m)])
    assert torch.equal(got, want)
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-6 * k**0.5 * 4)


@pytest.mark.parametrize("dtype", HALF)
def test_a_row_gets_the_same_bits_in_any_batch(module, dtype):
    w = _rand(256, 1030, seed=1, dtype=dtype)
    hw = HalfPanelWeight.pack(w, dtype, module)
    x = _rand(150, 1030, seed=2)
    together = hw.matmul(x)
    for i in (0, 5, 6, 63, 64, 149):
        assert torch.equal(hw.matmul(x[i : i + 1])[0], together[i])
        assert torch.equal(hw.matmul(x[: i + 1])[i], together[i])
    assert torch.equal(hw.matmul_batch_invariant(x), together)


def test_the_panels_hold_exactly_the_weight_or_nothing(module):
    w = _rand(192, 40, seed=5, dtype=torch.bfloat16)
    hw = HalfPanelWeight.pack(w, torch.bfloat16, module)
    assert torch.equal(hw.dense(), w) and hw.shape == w.shape
    ids = torch.tensor([[0, 63, 64, 191], [5, 5, 100, 1]])
    assert torch.equal(hw.rows(ids), w[ids])
    for bad in (-1, 192):
        with pytest.raises(IndexError, match="out of range"):
            hw.rows(torch.tensor([0, bad]))
    with pytest.raises(ValueError, match="features"):
        hw.matmul(torch.zeros(2, 39))
    assert HalfPanelWeight.pack(_rand(192, 40, seed=5), torch.bfloat16, module) is None  # fp32 values: kept
    assert HalfPanelWeight.pack(_rand(100, 40, seed=5, dtype=torch.bfloat16), torch.bfloat16, module) is None
    assert HalfPanelWeight.pack(w, torch.float32, module) is None
    assert HalfPanelWeight.pack(_rand(64, 40, seed=5, dtype=torch.float16), torch.float16, module) is not None


def test_the_kernel_refuses_half_weights_outside_panels(module):
    with pytest.raises(RuntimeError, match="panels"):
        module.small_matmul(torch.zeros(2, 64), torch.zeros(64, 64, dtype=torch.bfloat16))


def _linears(model):
    return [m for m in model.modules() if type(m).__name__ in ("Linear", "MergedLinear")]


@pytest.mark.parametrize("dtype", HALF)
def test_an_engine_keeps_a_half_checkpoint_in_its_dtype(checkpoint_factory, monkeypatch, dtype):
    from forwardpass.attention import cpu_kernel

    if cpu_kernel.load_paged_decode() is None:
        pytest.skip("no C++ toolchain: the engine uses the PyTorch path")
    # hidden 128: q/k/v, o, gate/up, down and the tied embedding are whole panels
    path = checkpoint_factory("qwen3", hidden_size=128, intermediate_size=256, head_dim=32,
                              tie_word_embeddings=True, dtype=dtype)
    prompts = random_prompts(3, lengths=[5, 70, 130], seed=7)  # 70 and 130 rows: the multi-row path
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    runs = {}
    for half in (True, False):
        monkeypatch.setenv("FORWARDPASS_HALF_WEIGHTS", "1" if half else "0")
        llm = LLM(str(path), cpu_kernels=True, max_model_len=256, enable_prefix_caching=False)
        model, plan = llm.engine.model, llm.engine.core.plan
        assert plan.weight_storage == (dtype if half else torch.float32)
        kind = HalfPanelWeight if half else PackedWeight
        assert all(isinstance(m.weight, kind) for m in _linears(model))
        assert isinstance(model.model.embed_tokens.weight, kind)
        assert model.model.decode_stack is not None  # decode steps read the half panels from C++ too
        if half:
            formats = weight_formats(model)  # what the banner and /v1/models say
            assert formats["projections"].startswith(str(dtype).removeprefix("torch.") + " via the panel")
            stored = sum(m.weight.panels.nbytes for m in _linears(model))
            assert stored == sum(m.weight.panels.numel() * 2 for m in _linears(model))
        runs[half] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in
                      llm.generate(prompts, params, use_tqdm=False)]  # fmt: skip
        llm.engine.check_invariants()
    for (tokens, lps), (fp32_tokens, fp32_lps) in zip(runs[True], runs[False]):
        # the same weight values; prefill sums in another order than oneDNN's GEMM: tokens agree,
        # log-probs to rounding
        assert tokens == fp32_tokens
        got = torch.tensor([next(iter(d.values())).logprob for d in lps])
        want = torch.tensor([next(iter(d.values())).logprob for d in fp32_lps])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_an_fp32_checkpoint_stays_fp32(checkpoint_factory):
    from forwardpass.config import EngineConfig
    from forwardpass.layers.weight_methods import method_for
    from forwardpass.models.prepare import resolve_plan

    path = checkpoint_factory("qwen3")
    plan = resolve_plan(EngineConfig(cpu_kernels=True), path)
    assert plan.weight_storage == torch.float32
    if plan.packed_weights:
        assert method_for(plan, "projection").name == "fp32-packed"
