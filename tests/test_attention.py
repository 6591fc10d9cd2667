"""Every attention backend against the naive reference (which materializes S and P)."""

from __future__ import annotations

import pytest
import torch

from forwardpass.attention import attention
from forwardpass.attention.paged import paged_decode_attention, paged_prefill_attention, write_kv


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
@pytest.mark.parametrize("mode", ["causal", "bidirectional", "cross", "causal_chunk", "sliding"])
def test_sdpa_matches_naive(mode, hq, hkv):
    nq, nk = {"causal": (37, 37), "bidirectional": (29, 29), "cross": (23, 11), "causal_chunk": (9, 40),
              "sliding": (30, 30)}[mode]
    q, k, v = rand(2, hq, nq, 32, seed=1), rand(2, hkv, nk, 32, seed=2), rand(2, hkv, nk, 32, seed=3)
    kwargs = {"causal": mode.startswith("causal") or mode == "sliding",
                  "sliding_window": 8 if mode == "sliding" else None}
    ref = attention(q, k, v, backend="naive", **kwargs)
    out = attention(q, k, v, backend="sdpa", **kwargs)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_key_padding_mask():
    q, k, v = rand(2, 4, 1, 16, seed=1), rand(2, 4, 10, 16, seed=2), rand(2, 4, 10, 16, seed=3)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, 6:] = False
    out = attention(q, k, v, key_padding_mask=mask, backend="sdpa")
    alone = attention(q[1:], k[1:, :, :6], v[1:, :, :6], backend="naive")
    torch.testing.assert_close(out[1:], alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(out, attention(q, k, v, key_padding_mask=mask, backend="naive"), atol=1e-5,
                               rtol=0)


def _scattered_cache(lengths, hkv=2, d=16, block_size=4, num_blocks=64, seed=0):
    """Write each sequence's K/V into randomly chosen, non-contiguous blocks; return
    tables and dense copies."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.zeros(2, num_blocks, block_size, hkv, d)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, dense = [], []
    for n in lengths:
        nb = -(-n // block_size)
        table = torch.tensor([perm.pop() for _ in range(nb)])
        k, v = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
        pos = torch.arange(n)
        write_kv(cache, k, v, table[pos // block_size] * block_size + pos % block_size)
        tables.append(table)
        dense.append((k, v))
    return cache, tables, dense


@pytest.mark.parametrize("window", [None, 5])
def test_paged_decode_matches_naive(window):
    lengths = [7, 13, 1, 20]
    cache, tables, dense = _scattered_cache(lengths)
    q = rand(len(lengths), 4, 16, seed=9)
    bt = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True)
    out = paged_decode_attention(q, cache, bt, torch.tensor(lengths), max(lengths), sliding_window=window)
    for i, (k, v) in enumerate(dense):
        ref = attention(q[i][None, :, None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], causal=True,
                        sliding_window=window, backend="naive")
        torch.testing.assert_close(out[i], ref[0, :, 0], atol=1e-5, rtol=0)


def test_paged_chunked_prefill_matches_naive():
    cache, tables, dense = _scattered_cache([23])
    k, v = dense[0]
    q = rand(6, 4, 16, seed=4)  # the last 6 positions of a 23-token context
    out = paged_prefill_attention(q, cache, tables[0], 23)
    ref = attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], causal=True,
                    backend="naive")[0].transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("window", [0, 5])
# d=12: not 8-wide
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 16), (8, 8, 32), (6, 3, 16), (8, 4, 128), (4, 2, 12)])
# one sequence: its heads split over threads
@pytest.mark.parametrize("lengths", [[7, 13, 1, 20, 16, 37], [19]])
def test_cpu_kernel_matches_naive(window, hq, hkv, d, lengths):
    from forwardpass.attention.cpu_kernel import load_paged_decode

    kernel = load_paged_decode()
    if kernel is None:
        pytest.skip("no C++ toolchain: the engine uses the PyTorch path (tested above)")
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # fewer sequences than threads: work items are (sequence, range of KV heads)
    try:
        _check_kernel(kernel, window, hq, hkv, d, lengths)
    finally:
        torch.set_num_threads(before)


def _check_kernel(kernel, window, hq, hkv, d, lengths):
    cache, tables, dense = _scattered_cache(lengths, hkv=hkv, d=d)
    q = rand(len(lengths), hq, d, seed=9)
    bt = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True)
    out = kernel(q, cache, bt, torch.tensor(lengths), d**-0.5, window)
    for i, (k, v) in enumerate(dense):
        ref = attention(q[i][None, :, None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], causal=True,
                        sliding_window=window or None, backend="naive")
        torch.testing.assert_close(out[i], ref[0, :, 0], atol=1e-5, rtol=0)
