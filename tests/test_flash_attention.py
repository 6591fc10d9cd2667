"""FlashAttention in PyTorch (attention/flash.py) against the naive reference, and its memory."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from forwardpass.attention import attention, available_backends
from forwardpass.attention.flash import flash_attention, tile_footprint_bytes


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


CASES = {
    # name: (nq, nk, causal, window)
    "causal": (37, 37, True, None),
    "bidirectional": (29, 29, False, None),
    "cross": (23, 11, False, None),
    "chunk_n_lt_m": (9, 40, True, None),
    "decode": (1, 53, True, None),
    "sliding": (70, 70, True, 8),
    "sliding_chunk": (13, 61, True, 17),
    "sliding_bidirectional": (21, 21, False, 5),
}


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (6, 1)])  # MHA, GQA, MQA
@pytest.mark.parametrize("case", sorted(CASES))
def test_flash_matches_naive(case, hq, hkv):
    nq, nk, causal, window = CASES[case]
    q, k, v = rand(2, hq, nq, 24, seed=1), rand(2, hkv, nk, 24, seed=2), rand(2, hkv, nk, 24, seed=3)
    ref = attention(q, k, v, causal=causal, sliding_window=window, backend="naive")
    for bq, bk in [(16, 16), (7, 5), (128, 128), (1, 3)]:  # odd tiles, tiles larger than the input
        out = flash_attention(q, k, v, causal=causal, sliding_window=window, block_q=bq, block_k=bk)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_flash_padding_softcap_scale_and_backend_name():
    q, k, v = rand(2, 4, 1, 16, seed=1), rand(2, 2, 10, 16, seed=2), rand(2, 2, 10, 16, seed=3)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, 6:] = False
    kwargs = {"key_padding_mask": mask, "softcap": 5.0, "scale": 0.3}
    ref = attention(q, k, v, backend="naive", **kwargs)
    torch.testing.assert_close(attention(q, k, v, backend="flash", **kwargs), ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(flash_attention(q, k, v, causal=False, block_k=3, **kwargs), ref, atol=1e-5,
                               rtol=0)
    assert "flash" in available_backends()


def test_flash_query_that_sees_nothing_outputs_zeros():
    q, k, v = rand(1, 2, 3, 8, seed=1), rand(1, 2, 5, 8, seed=2), rand(1, 2, 5, 8, seed=3)
    mask = torch.zeros(1, 5, dtype=torch.bool)
    out = flash_attention(q, k, v, causal=False, key_padding_mask=mask, block_k=2)
    assert torch.equal(out, torch.zeros_like(out))


def test_flash_sdpa_softcap_agree():
    q, k, v = rand(1, 4, 12, 16, seed=4) * 4, rand(1, 4, 12, 16, seed=5) * 4, rand(1, 4, 12, 16, seed=6)
    ref = attention(q, k, v, causal=True, softcap=2.0, backend="naive")
    torch.testing.assert_close(attention(q, k, v, causal=True, softcap=2.0, backend="sdpa"), ref, atol=1e-5,
                               rtol=0)
    torch.testing.assert_close(attention(q, k, v, causal=True, softcap=2.0, backend="flash"), ref, atol=1e-5,
                               rtol=0)


_PEAK_SCRIPT = """
import resource, sys, time, torch
from forwardpass.attention.flash import flash_attention


def peak_rss_kib():
    # VmHWM belongs to this process's address space. ru_maxrss does not do for this on Linux: exec
    # keeps the parent's high-water mark, so a child of a large pytest process would start above
    # anything it allocates.
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


torch.set_num_threads(2)
mode, n, d = sys.argv[1], int(sys.argv[2]), 64
q, k, v = (torch.randn(1, 1, n, d) for _ in range(3))


def run(q, k, v):
    if mode == "flash":
        return flash_attention(q, k, v, causal=True)
    return torch.softmax((q[0, 0] @ k[0, 0].T) / d ** 0.5, -1) @ v[0, 0]  # the reference: the whole N x N


run(q[:, :, :256], k[:, :, :256], v[:, :, :256])  # one-time library set-up is not the algorithm's memory
before = peak_rss_kib()
t0 = time.perf_counter()
out = run(q, k, v)
dt = time.perf_counter() - t0
after = peak_rss_kib()
err = 0.0
if mode == "flash":  # spot-check a few query rows against the exact softmax of those rows only
    rows = torch.tensor([0, 1, 4095, n - 1])
    s = (q[0, 0, rows] @ k[0, 0].T) / d ** 0.5
    s = s.masked_fill(torch.arange(n)[None, :] > rows[:, None], float("-inf"))
    err = (out[0, 0, rows] - torch.softmax(s, -1) @ v[0, 0]).abs().max().item()
print((after - before) * 1024, dt, err)
"""


def _peak(mode: str, n: int) -> tuple[float, float, float]:
    res = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, mode, str(n)], capture_output=True, text=True,
                         timeout=300, check=False)
    assert res.returncode == 0, res.stderr
    grown, seconds, err = (float(x) for x in res.stdout.split())
    return grown, seconds, err


def test_flash_peak_memory_at_16k():
    """N=16384: the N×N fp32 score matrix alone would be 1 GiB; flash must stay a small fraction.
    Each measurement runs in a fresh process (the peak RSS is a high-water mark)."""
    grown, seconds, err = _peak("flash", 16384)
    naive_grown, _, _ = _peak("naive", 4096)
    print(f"flash N=16384 d=64 causal: peak RSS growth {grown / 2**20:.1f} MiB, {seconds:.2f}s, max err "
          f"{err:.2e}; naive N=4096 (64 MiB of scores): {naive_grown / 2**20:.1f} MiB")
    assert naive_grown >= 60 * 2**20  # the measurement does see an N×N matrix
    assert grown < 64 * 2**20  # < 1/16 of the 1 GiB the scores would need
    assert err < 1e-5
    assert tile_footprint_bytes(64) < 256 * 1024  # the working set of one tile step fits a core's cache
