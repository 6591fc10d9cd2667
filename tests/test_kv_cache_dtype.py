"""``kv_cache_dtype``: paged K/V stored in float16 or bfloat16 under a float32 model. Stored values are the
model's K/V rounded once; every reader (the PyTorch paths, the compiled store and decode kernel, the decode
stack) widens them back exactly, so each path equals the float32 math on the rounded values; the engine's
outputs stay close to a float32 cache's; half the bytes hold twice the blocks; and what
cannot take it says so."""

from __future__ import annotations

import pytest
import torch

from forwardpass import LLM, SamplingParams
from forwardpass.attention import attention
from forwardpass.attention.paged import paged_decode_attention, paged_prefill_attention, write_kv
from forwardpass.errors import ConfigError
from tests.helpers.checkpoints import random_prompts


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _half_cache(lengths, hkv, d, dtype, block_size=4, num_blocks=64):
    """Each sequence's K/V written through write_kv into scattered blocks of a ``dtype`` cache; also the dense
    K/V rounded the same way (what every reader must see)."""
    cache = torch.zeros(2, num_blocks, block_size, hkv, d, dtype=dtype)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
    tables, dense = [], []
    for i, n in enumerate(lengths):
        table = torch.tensor([perm.pop() for _ in range(-(-n // block_size))])
        k, v = _rand(n, hkv, d, seed=10 + i), _rand(n, hkv, d, seed=20 + i)
        pos = torch.arange(n)
        write_kv(cache, k, v, table[pos // block_size] * block_size + pos % block_size)
        tables.append(table)
        dense.append((k.to(dtype).float(), v.to(dtype).float()))
    return cache, tables, dense


def _naive(q, k, v, window=None):
    return attention(q[None, :, None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], causal=True,
                     sliding_window=window, backend="naive")[0, :, 0]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_pytorch_paths_read_the_rounded_values(dtype):
    lengths = [7, 13, 1, 20]
    cache, tables, dense = _half_cache(lengths, hkv=2, d=16, dtype=dtype)
    q = _rand(len(lengths), 4, 16, seed=3)
    bt = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True)
    out = paged_decode_attention(q, cache, bt, torch.tensor(lengths), max(lengths))
    assert out.dtype == torch.float32
    for i, (k, v) in enumerate(dense):
        torch.testing.assert_close(out[i], _naive(q[i], k, v), atol=1e-5, rtol=0)
    chunk = _rand(6, 4, 16, seed=4)  # the last 6 queries of the 20-token sequence
    k, v = dense[3]
    ref = attention(chunk.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                    causal=True,
                    backend="naive")[0].transpose(0, 1)  # fmt: skip
    torch.testing.assert_close(paged_prefill_attention(chunk, cache, tables[3], 20), ref, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def ops():
    from forwardpass.attention import cpu_kernel

    if cpu_kernel.load_paged_decode() is None:
        pytest.skip("no C++ toolchain: the engine uses the PyTorch path")
    return cpu_kernel.fused_ops_for(cpu_kernel.load_paged_decode())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compiled_store_rounds_like_torch(ops, dtype):
    cache_py = torch.zeros(2, 8, 4, 3, 20, dtype=dtype)  # D = 20: an 8-wide body and a 4-value tail
    cache_cpp = cache_py.clone()
    # K and V as strided views of a projection, some values beyond fp16's step
    qkv = _rand(5, 9 * 20, seed=5) * 70
    k, v = qkv[:, 3 * 20:6 * 20].view(5, 3, 20), qkv[:, 6 * 20:].view(5, 3, 20)
    slots = torch.tensor([3, 17, 0, 31, 9])
    write_kv(cache_py, k, v, slots)
    ops.write_kv_(cache_cpp, k, v, slots)
    assert torch.equal(cache_cpp, cache_py)


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("hq,hkv,d,lengths",
                         [(8, 4, 128, [19]), (4, 2, 16, [7, 13, 1, 20, 37]), (4, 2, 12, [9, 3])])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compiled_decode_reads_half_caches(ops, window, hq, hkv, d, lengths, dtype):
    cache, tables, dense = _half_cache(lengths, hkv=hkv, d=d, dtype=dtype)
    q = _rand(len(lengths), hq, d, seed=9)
    bt = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # one sequence: its heads split over two threads
    try:
        out = ops.paged_decode(q, cache, bt, torch.tensor(lengths), d**-0.5, window)
    finally:
        torch.set_num_threads(before)
    for i, (k, v) in enumerate(dense):
        torch.testing.assert_close(out[i], _naive(q[i], k, v, window or None), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kv", ["float16", "bfloat16"])
def test_engine_outputs_stay_close_to_a_float32_cache(checkpoint_factory, kv):
    path = checkpoint_factory("qwen3")
    prompts = random_prompts(2, [11, 30])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    runs = {}
    for dtype in ("auto", kv):
        llm = LLM(path, num_kv_blocks=32, cpu_kernels=True, kv_cache_dtype=dtype, enable_prefix_caching=False)
        runs[dtype] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        if dtype == kv:
            assert llm.engine.core.runner.kv_caches[0].dtype == getattr(torch, kv)
            assert llm.engine.model.model.decode_stack is not None  # the compiled decode path, stack included
    for ref, got in zip(runs["auto"], runs[kv]):
        assert got.token_ids == ref.token_ids
        for a, b in zip(ref.logprobs, got.logprobs):  # each step's chosen token
            t = next(iter(a))
            assert abs(a[t].logprob - b[t].logprob) < 2e-2


def test_half_the_bytes_hold_twice_the_blocks(checkpoint_factory):
    path = checkpoint_factory("qwen3")
    blocks = {kv: LLM(path, kv_cache_memory=1 << 22,
                      kv_cache_dtype=kv).engine.core.runner.kv_caches[0].shape[1]
              for kv in ("auto", "float16")}  # fmt: skip
    assert 2 * blocks["auto"] <= blocks["float16"] <= 2 * blocks["auto"] + 1  # the budget's remainder


def test_refused_where_it_does_not_apply(checkpoint_factory, tmp_path):
    from tests.helpers.attention_checkpoints import make_attention_checkpoint

    with pytest.raises(ConfigError) as err:
        LLM(checkpoint_factory("qwen3"), kv_cache_dtype="int8")
    assert err.value.param == "kv_cache_dtype"
    with pytest.raises(ConfigError, match="MLASpec") as err:  # latent caches: computed in the model's dtype
        LLM(make_attention_checkpoint(tmp_path / "mla", "deepseek_v2"), num_kv_blocks=32,
            kv_cache_dtype="float16")
    assert err.value.param == "kv_cache_dtype"


def test_auto_keeps_the_checkpoints_narrower_dtype(checkpoint_factory, tmp_path):
    """``kv_cache_dtype="auto"`` under a float32 engine on CPU: a bfloat16 (or float16) checkpoint keeps its
    K/V in its own dtype (engine/scheduling/checkpoint_defaults.py); a float32 one in float32; a model with
    other caches (MLA latents) in the model's dtype, without an error; an explicit value is kept."""
    import json
    import shutil

    from forwardpass.config import EngineConfig
    from forwardpass.engine.scheduling.checkpoint_defaults import with_checkpoint_defaults
    from tests.helpers.attention_checkpoints import make_attention_checkpoint

    fp32 = checkpoint_factory("qwen3")
    bf16 = tmp_path / "bf16"
    shutil.copytree(fp32, bf16)
    cfg = json.loads((bf16 / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    (bf16 / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}))
    auto = EngineConfig()
    assert with_checkpoint_defaults(auto, fp32).torch_kv_dtype == torch.float32
    assert with_checkpoint_defaults(auto, bf16).torch_kv_dtype == torch.bfloat16
    explicit = EngineConfig(kv_cache_dtype="float16")
    assert with_checkpoint_defaults(explicit, bf16).torch_kv_dtype == torch.float16
    mla = make_attention_checkpoint(tmp_path / "mla", "deepseek_v2")
    cfg = json.loads((mla / "config.json").read_text())
    (mla / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}))
    assert with_checkpoint_defaults(auto, mla).torch_kv_dtype == torch.float32
    llm = LLM(bf16, num_kv_blocks=32, cpu_kernels=True)
    assert llm.engine.core.runner.kv_caches[0].dtype == torch.bfloat16
    assert llm.engine.core.plan.kv_cache_dtype == torch.bfloat16
    assert llm.engine.model.model.decode_stack is not None
