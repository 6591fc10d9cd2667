"""The compiled per-layer ops of a decode step (``forwardpass/layers/norm.py``, ``mlp.py``; taken from the
execution plan) against the PyTorch modules they replace: RMSNorm, and q/k RMSNorm + rotary in place on the
qkv projection; and the engine switching them on exactly when it uses the compiled decode kernel."""

from __future__ import annotations

import pytest
import torch

from forwardpass.layers.norm import RMSNorm
from forwardpass.layers.rotary import RotaryEmbedding, apply_rotary


@pytest.fixture(scope="module")
def ops():
    from forwardpass.attention import cpu_kernel

    if cpu_kernel.load_paged_decode() is None:
        pytest.skip("no C++ toolchain: the engine uses the PyTorch path")
    return cpu_kernel.fused_ops_for(cpu_kernel.load_paged_decode())


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", [(1, 1024), (5, 64), (3, 4, 128), (0, 32)])
def test_rms_norm_matches_the_module(ops, shape):
    norm = RMSNorm(shape[-1], eps=1e-5)
    norm.weight.data = _rand(shape[-1], seed=1) + 1
    x = _rand(*shape, seed=2) * 3
    want = norm(x)
    norm.fused = ops
    got = norm(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)  # the mean's summation order only


@pytest.mark.parametrize("norms", [True, False])
@pytest.mark.parametrize("t,hq,hkv,d", [(1, 16, 8, 128), (5, 4, 2, 64), (3, 2, 2, 32)])
def test_qk_norm_rope_matches_the_modules(ops, norms, t, hq, hkv, d):
    qkv = _rand(t, (hq + 2 * hkv) * d, seed=3)
    cos, sin = RotaryEmbedding(d, 10000.0).cos_sin(torch.tensor([0, 7, 300, 4095, 2][:t]), torch.float32)
    qn, kn = RMSNorm(d, 1e-6), RMSNorm(d, 1e-6)
    qn.weight.data, kn.weight.data = _rand(d, seed=4), _rand(d, seed=5)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.reshape(t, hq, d), k.reshape(t, hkv, d)
    if norms:
        q, k = qn(q), kn(k)
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    got = qkv.clone()
    args = (qn.weight, kn.weight, 1e-6) if norms else (None, None, 0.0)
    ops.qk_norm_rope_(got, cos, sin, hq, hkv, d, *args)
    gq, gk, gv = got.split([hq * d, hkv * d, hkv * d], dim=-1)
    tol = 2e-6  # float rounding: the mean's summation order, fused multiply-adds (the kernel's -ffast-math)
    torch.testing.assert_close(gq.reshape(t, hq, d), want_q, rtol=tol, atol=tol)
    torch.testing.assert_close(gk.reshape(t, hkv, d), want_k, rtol=tol, atol=tol)
    assert torch.equal(gv, v)  # the values are left alone


def test_engine_uses_them_with_the_decode_kernel_only(ops, tmp_path):
    """An engine on the compiled path gives its RMSNorms, attention and MLPs the ops and every linear layer
    and the LM head the small-batch matmul (forwardpass/layers/small_matmul.py), and its greedy tokens equal
    an engine on the PyTorch / library path (logits within float rounding)."""
    from forwardpass import LLM, SamplingParams
    from forwardpass.layers.linear import Linear
    from forwardpass.layers.small_matmul import load_small_matmul
    from tests.helpers.checkpoints import make_checkpoint, random_prompts

    with_matmul = load_small_matmul() is not None

    path = make_checkpoint(tmp_path / "m", "qwen3")  # q/k norms
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    outs = {}
    for mode in (True, False):
        llm = LLM(path, num_kv_blocks=32, cpu_kernels=mode, enable_prefix_caching=False)
        model = llm.engine.model
        fused = [m for m in model.modules() if getattr(m, "fused", None) is not None]
        assert bool(fused) == mode
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        assert linears and all((m.small_matmul is not None) == (mode and with_matmul) for m in linears)
        # the LM head (here the tied embedding) multiplies through its weight method's small-batch matmul too
        head_method = model.model.embed_tokens.head_method if model.lm_head is None else model.lm_head.method
        assert (head_method.small_matmul is not None) == (mode and with_matmul)
        prompts = [{"prompt_token_ids": p} for p in random_prompts(3, [5, 17, 9])]
        outs[mode] = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(outs[True], outs[False], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            tok = next(iter(la))
            assert abs(la[tok].logprob - lb[tok].logprob) < 1e-4


@pytest.mark.parametrize("shape", [(1, 2 * 3072), (5, 2 * 64), (2, 3, 2 * 17), (0, 8)])
def test_silu_and_mul_matches_the_reference(ops, shape):
    from forwardpass.layers.activation import silu_and_mul

    gate_up = _rand(*shape, seed=6) * 4
    gate_up.view(-1)[:1] = -200.0  # far past exp's range: silu is 0 there, not a NaN
    want = silu_and_mul(gate_up)
    got = ops.silu_and_mul(gate_up)
    assert got.shape == want.shape
    assert torch.equal(got, want)  # ATen's silu and mul, called from C++: the same float operations


def test_write_kv_matches_the_reference(ops):
    from forwardpass.attention.paged import write_kv

    t, hkv, d = 3, 2, 16
    qkv = _rand(t, (4 + 2 * hkv) * d, seed=7)
    k = qkv[:, 4 * d : (4 + hkv) * d].view(t, hkv, d)  # strided views of the projection, as in a model
    v = qkv[:, (4 + hkv) * d :].view(t, hkv, d)
    slots = torch.tensor([5, 0, 31])
    want, got = torch.zeros(2, 4, 8, hkv, d), torch.zeros(2, 4, 8, hkv, d)
    write_kv(want, k, v, slots)
    ops.write_kv_(got, k, v, slots)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.write_kv_(got, k, v, torch.tensor([5, 0, 32]))
