"""fp32 weights packed once for oneDNN and read in place by our small-batch kernel
(``forwardpass/layers/packed.py``): the panels hold exactly the weight, the kernel on them equals ``x @ W.T``
in float64 for both builds, a row's result does not depend on its batch, large batches take oneDNN on the same
buffer, and an engine built with its compiled CPU path packs its projections and tied LM head and generates
what the plain weights do."""

from __future__ import annotations

import logging

import pytest
import torch

from forwardpass import LLM, SamplingParams
from forwardpass.layers import small_matmul as sm
from forwardpass.layers.linear import Linear
from forwardpass.layers.packed import PackedWeight
from forwardpass.layers.weight_interface import matmul
from forwardpass.layers.weight_methods import PackedFp32Method, method_for
from forwardpass.models.prepare import resolve_plan
from tests.helpers.checkpoints import random_prompts
from tests.helpers.isa import builds

ISAS = builds("avx512", {"avx512f"})
MAX_ROWS = {"avx2": 32, "avx512": 64}  # small_matmul.MAX_ROWS of each build


@pytest.fixture(scope="module", params=ISAS)
def build(request):
    try:
        return request.param, sm.kernel_for(request.param).load(logging.getLogger(__name__))
    except Exception as exc:  # noqa: BLE001 - no compiler here: the engine keeps plain weights
        pytest.skip(f"cannot build the kernel: {exc}")


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _packed(w, module):
    pw = PackedWeight.pack(w, module)
    if pw is None:
        pytest.skip("this oneDNN does not pack fp32 weights in 64-wide panels")
    return pw


# N: one panel, several, an odd count; K: 1, not a multiple of oneDNN's 16-k padding,
# longer than a 64/256-k chunk
@pytest.mark.parametrize("n,k", [(64, 1), (128, 40), (192, 17), (320, 300), (256, 1030)])
def test_the_panels_hold_exactly_the_weight(build, n, k):
    w = _rand(n, k, seed=n + k)
    pw = _packed(w, build[1])
    assert pw.panels.shape[0] == n // 64 and pw.panels.shape[1] >= k and pw.panels.shape[2] == 64
    assert torch.equal(pw.dense(), w)
    ids = torch.tensor([[0, 63, n - 64, n - 1], [5, 5, n // 2, 1]])
    assert torch.equal(pw.rows(ids), w[ids])
    for bad in (-1, n):
        with pytest.raises(IndexError, match="out of range"):
            pw.rows(torch.tensor([0, bad]))


# rows: every register-block tail of both builds (1..6 of the AVX-512 build's 6-row blocks, the chunked K from
# 7 on) up to MAX_ROWS, and past it (oneDNN's GEMM on the same buffer)
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 32, 33, 64, 65, 130])
@pytest.mark.parametrize("n,k", [(64, 1), (192, 17), (256, 1030)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_on_panels_equals_the_reference(build, m, n, k, bias):
    isa, module = build
    w, x = _rand(n, k, seed=n), _rand(m, k, seed=m + 1)
    b = _rand(n, seed=3) if bias else None
    pw = _packed(w, module)
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    got = pw.matmul(x, b) if m <= MAX_ROWS[isa] else module.small_matmul(x, pw.panels, b)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6 * k**0.5 * 4)


def test_a_row_gets_the_same_bits_in_any_batch(build):
    isa, module = build
    w = _rand(256, 1030, seed=1)
    pw = _packed(w, module)
    x = _rand(MAX_ROWS[isa], 1030, seed=2)
    together = module.small_matmul(x, pw.panels, None)
    for i in (0, 5, 6, 7, MAX_ROWS[isa] - 1):
        assert torch.equal(module.small_matmul(x[i : i + 1], pw.panels, None)[0], together[i])
        assert torch.equal(module.small_matmul(x[: i + 1], pw.panels, None)[i], together[i])


def test_large_batches_take_onednn_on_the_same_buffer(build):
    isa, module = build
    w, x = _rand(128, 96, seed=4), _rand(MAX_ROWS[isa] + 40, 96, seed=5)
    pw = _packed(w, module)
    pw._kernel = CountingKernel(module)
    out = matmul(x.view(2, -1, 96), pw)  # 3-D activations, as a layer gets them
    assert pw._kernel.rows == [] and out.shape == (2, x.shape[0] // 2, 128)
    torch.testing.assert_close(out.reshape(-1, 128), x @ w.T, rtol=1e-5, atol=1e-5)
    matmul(x[:3], pw)
    assert pw._kernel.rows == [3]
    with pytest.raises(ValueError, match="features"):
        matmul(x[:3, :95], pw)


class CountingKernel:
    """The kernel module, counting the rows its small_matmul is called with."""

    def __init__(self, module):
        self.module, self.rows = module, []

    def panels_view(self, *args):
        return self.module.panels_view(*args)

    def small_matmul(self, x, *args):
        self.rows.append(x.shape[0])
        return self.module.small_matmul(x, *args)


class ShiftedView(CountingKernel):
    """A panels view one float off: what a different blocked layout would look like."""

    def panels_view(self, owner, ptr, panels, kp):
        return self.module.panels_view(owner, ptr + 4, panels, kp - 1)


def test_a_weight_stays_plain_where_the_layout_does_not_check_out(build):
    module = build[1]
    assert PackedWeight.pack(_rand(100, 32, seed=1), module) is None  # not whole panels
    assert PackedWeight.pack(_rand(64, 32, seed=1).double(), module) is None
    assert PackedWeight.pack(_rand(128, 48, seed=2), ShiftedView(module)) is None


def test_packing_is_switched_off_by_the_environment(build, monkeypatch, checkpoint_factory):
    """``FORWARDPASS_PACKED_WEIGHTS=0`` is read when the plan is resolved: its projections' method is then
    plain fp32. A layer built with the packing method packs its own weight once, after loading."""
    from forwardpass.attention import cpu_kernel
    from forwardpass.config import EngineConfig
    from forwardpass.plan import CompiledKernels, ExecutionPlan, building_with_plan

    if cpu_kernel.load_paged_decode() is None:
        pytest.skip("no C++ toolchain: the engine uses the PyTorch path")
    path, config = checkpoint_factory("qwen3"), EngineConfig(cpu_kernels=True)
    monkeypatch.setenv("FORWARDPASS_PACKED_WEIGHTS", "0")
    assert method_for(resolve_plan(config, path), "projection").name == "fp32+small-matmul"
    monkeypatch.delenv("FORWARDPASS_PACKED_WEIGHTS")
    assert method_for(resolve_plan(config, path), "projection").name == "fp32-packed"
    module = build[1]
    plan = ExecutionPlan(packed_weights=True, kernels=CompiledKernels(small_matmul=module.small_matmul,
                                                                      small_matmul_module=module))
    with building_with_plan(plan):
        layer = Linear(32, 128)
    assert isinstance(layer.method, PackedFp32Method)
    layer.weight.data = _rand(128, 32, seed=6)
    layer.process_weights_after_loading()
    assert isinstance(layer.weight, PackedWeight) and torch.equal(layer.weight.dense(),
                                                                  _rand(128, 32, seed=6))
    with pytest.raises(RuntimeError, match="where it was packed"):
        layer.to(torch.float64)


def test_an_engine_packs_its_weights_and_generates_what_plain_weights_do(checkpoint_factory, monkeypatch):
    from forwardpass.attention import cpu_kernel

    if cpu_kernel.load_paged_decode() is None:
        pytest.skip("no C++ toolchain: the engine uses the PyTorch path")
    # hidden 128: q/k/v, o, gate/up, down and the tied embedding are whole panels
    path = checkpoint_factory("qwen3", hidden_size=128, intermediate_size=256, head_dim=32,
                              tie_word_embeddings=True)
    prompts = random_prompts(3, lengths=[5, 70, 130], seed=7)  # the 130-token prompt's prefill takes oneDNN
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    runs = {}
    for packed in (True, False):
        monkeypatch.setenv("FORWARDPASS_PACKED_WEIGHTS", "1" if packed else "0")
        llm = LLM(str(path), cpu_kernels=True, max_model_len=256, enable_prefix_caching=False)
        model = llm.engine.model
        linears = [m for m in model.modules() if type(m).__name__ in ("Linear", "MergedLinear")]
        assert all(isinstance(m.weight, PackedWeight) == packed for m in linears)
        assert isinstance(model.model.embed_tokens.weight, PackedWeight) == packed
        assert model.model.decode_stack is not None  # decode steps read the panels from C++ too
        runs[packed] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in
                        llm.generate(prompts, params, use_tqdm=False)]  # fmt: skip
        llm.engine.check_invariants()
    for (tokens, lps), (plain_tokens, plain_lps) in zip(runs[True], runs[False]):
        # the sums run in another order: greedy tokens agree, log-probs to rounding
        assert tokens == plain_tokens
        got = torch.tensor([next(iter(d.values())).logprob for d in lps])
        want = torch.tensor([next(iter(d.values())).logprob for d in plain_lps])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
