"""The compiled small-batch fp32 matmul (``forwardpass/layers/small_matmul.py``) against its reference,
``x @ W.T`` in float64, for both builds (AVX-512 where this CPU runs it, AVX2/FMA), and ``linear`` taking
it for decode-sized batches only. The engine using it: tests/test_fused_ops.py, with
the other compiled ops."""

from __future__ import annotations

import logging

import pytest
import torch

from forwardpass.layers import small_matmul as sm
from tests.helpers.isa import builds

ISAS = builds("avx512", {"avx512f"})


@pytest.fixture(scope="module", params=ISAS)
def kernel(request):
    try:
        return sm.kernel_for(request.param).load(logging.getLogger(__name__)).small_matmul
    except Exception as exc:  # noqa: BLE001 - no compiler here: the engine falls back to oneDNN
        pytest.skip(f"cannot build the kernel: {exc}")


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# every register-block tail: rows not a multiple of 4 (or 2), weight rows not a multiple of 4 or of the
# 16-row thread tile, K not a multiple of the vector width (8 or 16); up to the engine's MAX_ROWS and past it.
# From 17 rows on the AVX-512 build takes its broadcast kernel: blocks of 2, 3 and 4 vectors of 16 rows, a
# last block with fewer (100 = 64 + 36, 130 = 2·64 + 2), weight rows not a multiple of its 12/8/6-row blocks
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (1, 7, 5), (2, 33, 100), (3, 64, 1024), (4, 17, 31),
                                   (5, 100, 17), (7, 48, 520), (16, 300, 256), (17, 40, 1536), (32, 65, 1000),
                                   (33, 9, 64), (64, 50, 512), (100, 70, 300), (130, 13, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_the_reference(kernel, m, n, k, bias):
    x, w = _rand(m, k, seed=m), _rand(n, k, seed=n + 1)
    b = _rand(n, seed=3) if bias else None
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    got = kernel(x, w, b)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    # fp32 sums of k products of N(0,1) values: error grows like sqrt(k) ulps of the row's magnitude
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6 * k**0.5 * 4)


def test_kernel_reads_strided_inputs_as_their_values(kernel):
    x = _rand(6, 40, seed=1)[:, :32]  # not contiguous
    w = _rand(32, 20, seed=2).T  # [20, 32], a transposed view
    torch.testing.assert_close(kernel(x, w), x @ w.T, rtol=1e-5, atol=1e-5)


def test_kernel_refuses_what_it_cannot_compute(kernel):
    with pytest.raises(RuntimeError, match="float32"):
        kernel(torch.ones(2, 4, dtype=torch.float64), torch.ones(3, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="expected"):
        kernel(torch.ones(2, 4), torch.ones(3, 5))


def test_linear_takes_it_for_small_batches_only():
    from forwardpass.layers.dense_matmul import dense_matmul

    calls = []

    def spy(x, w, b=None):
        calls.append(x.shape[0])
        return x @ w.T if b is None else x @ w.T + b

    w = _rand(8, 16, seed=4)
    for rows in (1, sm.MAX_ROWS, sm.MAX_ROWS + 1):
        x = _rand(rows, 16, seed=rows)
        with torch.no_grad():  # the engine's setting (with autograd on, linear is F.linear)
            got = dense_matmul(x, w, small_matmul=spy)
        torch.testing.assert_close(got, x @ w.T, rtol=1e-5, atol=1e-5)
    assert calls == [1, sm.MAX_ROWS]  # the prefill-sized batch went to oneDNN

