"""Sliding-window KV cache groups that free blocks while requests run; Mistral, Qwen2 windowed layers,
Gemma 2 and Gemma 3 against transformers; the start-up capacity check; bad window configs."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from forwardpass import LLM, SamplingParams
from forwardpass.engine.scheduling.kv_cache import KVCacheManager
from forwardpass.engine.scheduling.kv_cache_spec import (
    NULL_BLOCK,
    FullAttentionSpec,
    KVCacheGroup,
    SlidingWindowSpec,
    layer_specs,
    plan_groups,
)
from forwardpass.engine.scheduling.sequence import Sequence
from forwardpass.errors import ConfigError, ForwardpassError
from forwardpass.models.model_spec import ModelSpec
from forwardpass.sampling.params import SamplingParams as SP
from tests.helpers.attention_checkpoints import make_attention_checkpoint
from tests.helpers.checkpoints import random_prompts
from tests.helpers.oracle import hf_greedy, hf_model

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cache = {}

    def make(variant, **overrides):
        key = (variant, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = make_attention_checkpoint(tmp_path_factory.mktemp(variant), variant, **overrides)
        return cache[key]

    return make


# ----- the KV cache manager alone ------------------------------------------------------------------
def _seq(seq_id, n_prompt):
    return Sequence(request_id=str(seq_id), prompt_token_ids=list(range(3, 3 + n_prompt)),
                    params=SP(max_tokens=1000))


def test_window_group_frees_blocks_behind_the_window():
    window, bs = 10, 4
    full = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_dim=4)
    slide = SlidingWindowSpec(block_size=bs, num_kv_heads=1, head_dim=4, sliding_window=window)
    kv = KVCacheManager([KVCacheGroup(full, (0,), 64), KVCacheGroup(slide, (1,), 64)])
    seq = _seq(1, 6)
    assert kv.allocate_slots(seq, 6) is not None
    seq.num_computed_tokens = 6
    for _ in range(60):  # decode one token at a time
        seq.append_token(7)
        assert kv.allocate_slots(seq, 1) is not None
        start = seq.num_computed_tokens
        full_table, slide_table = kv.block_tables(seq)
        assert NULL_BLOCK not in full_table
        freed = slide.freeable_prefix_blocks(start)
        assert slide_table[:freed] == [NULL_BLOCK] * freed and NULL_BLOCK not in slide_table[freed:]
        # the window of the query at `start` reaches back to start - window + 1: that block is kept
        assert (start - window + 1) // bs <= freed or start < window
        assert len(slide_table) - freed <= slide.max_blocks_per_sequence(10_000, 1)
        kv.check_invariants([seq])
        seq.num_computed_tokens += 1
    assert kv.pools[1].num_free > kv.pools[0].num_free  # the windowed pool got blocks back
    kv.free(seq)
    kv.check_invariants([])
    assert kv.num_free_blocks == kv.num_blocks


def test_windowed_groups_switch_prefix_caching_off_with_a_log_line(caplog):
    slide = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_dim=4, sliding_window=8)
    with caplog.at_level(logging.INFO, logger="forwardpass.engine.scheduling.kv_cache"):
        kv = KVCacheManager([KVCacheGroup(slide, (0,), 8)], enable_prefix_caching=True)
    assert not kv.enable_prefix_caching
    assert "prefix caching is off" in caplog.text


def test_layer_specs_group_full_and_sliding_layers():
    spec = ModelSpec(name="m", architecture="Gemma2ForCausalLM", hidden=64, layers=4,
                     heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512,
                     layer_windows=(16, None, 16, None))
    groups = plan_groups(layer_specs(spec, 8, torch.float32), None, 32)
    assert sorted(g.layer_ids for g in groups) == [(0, 2), (1, 3)]
    assert {type(g.spec).__name__ for g in groups} == {"FullAttentionSpec", "SlidingWindowSpec"}
    window = next(g.spec for g in groups if isinstance(g.spec, SlidingWindowSpec))
    assert window.max_blocks_per_sequence(4096, 16) == -(-(16 - 1 + 16) // 8) + 1  # 5, not 512


# ----- parity with transformers ---------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["mistral_w16", "qwen2_window_layers", "gemma2", "gemma3"])
def test_windowed_models_match_transformers_alone_and_batched(ckpt, variant):
    path = ckpt(variant)
    hf = hf_model(path)
    prompts = random_prompts(3, [45, 9, 70], seed=3)  # two prompts longer than the 16/20-token window
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    # chunked prefill: 16-token chunks, so later chunks read K/V through freed-and-reused tables
    llm = LLM(path, num_kv_blocks=64, block_size=8, max_num_batched_tokens=16)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    expected = [hf_greedy(hf, p, 20) for p in prompts]
    assert batched == expected, variant
    alone = llm.generate([prompts[2]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == expected[2]
    llm.engine.check_invariants()
    with torch.no_grad():  # the whole prompt at once (no cache) agrees to rounding as well
        ref = hf(torch.tensor([prompts[2]])).logits[0].float()
        ours = llm.engine.model.compute_logits(llm.engine.model(torch.tensor(prompts[2]), torch.arange(70)))
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_long_generation_runs_inside_a_pool_that_fits_only_if_blocks_are_freed(ckpt):
    """Window 16, block 8: 4 requests of 30 + 160 tokens (10x the window) would need 4 x 24 blocks
    without freeing; the pool has 24 and a sequence holds at most 5."""
    path = ckpt("mistral_w16")
    llm = LLM(path, num_kv_blocks=24, block_size=8, max_num_batched_tokens=16, max_num_seqs=4)
    core = llm.engine.core
    # admitted with max_position_embeddings, though 24 blocks hold 192 tokens
    assert core.max_model_len == 512
    prompts = random_prompts(4, [30, 12, 25, 7], seed=7)
    params = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    hf = hf_model(path)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 160)
    llm.engine.check_invariants()
    kv = core.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_windowed_sequences_preempted_and_recomputed_still_match(ckpt):
    """A pool of 8 blocks: four decoding sequences of three live blocks each cannot all run; preemption
    recomputes them from scratch with fresh tables, and the tokens do not change."""
    path = ckpt("mistral_w16")
    llm = LLM(path, num_kv_blocks=8, block_size=8, max_num_batched_tokens=16, max_num_seqs=4)
    prompts = random_prompts(4, [30, 12, 25, 7], seed=8)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.core.scheduler.num_preemptions > 0
    hf = hf_model(path)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 60) for p in prompts]
    llm.engine.check_invariants()
    assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.num_blocks


def test_full_attention_model_is_refused_the_same_small_budget(checkpoint_factory):
    path = checkpoint_factory("llama")
    assert LLM(path, num_kv_blocks=24, block_size=8).engine.core.max_model_len == 24 * 8  # capped by the KV
    with pytest.raises(ConfigError) as err:
        LLM(path, num_kv_blocks=24, block_size=8, max_num_batched_tokens=16, max_model_len=512)
    assert err.value.param == "max_model_len"


def test_flash_backend_gives_the_same_greedy_tokens(ckpt):
    path = ckpt("gemma2")  # windows, softcap, GQA, chunked prefill, paged decode
    prompts = random_prompts(3, [45, 9, 30], seed=11)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = [
        [o.outputs[0].token_ids for o in LLM(path, num_kv_blocks=64, block_size=8, max_num_batched_tokens=16,
                                             attention_backend=b).generate(prompts, params, use_tqdm=False)]
        for b in ("naive", "flash")
    ]
    assert runs[0] == runs[1]


# ----- bad input -------------------------------------------------------------------------------------
BASE_CFG = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 512,
            "max_position_embeddings": 256}


@pytest.mark.parametrize("extra,param", [
    ({"sliding_window": 1024}, "sliding_window"),
    ({"sliding_window": 16, "layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding_window"),
])
def test_bad_window_configs_name_the_field(extra, param, tmp_path):
    with pytest.raises(ForwardpassError) as err:
        ModelSpec.from_config({**BASE_CFG, **extra})
    assert err.value.param == param
    (tmp_path / "config.json").write_text(json.dumps({**BASE_CFG, **extra}))
    with pytest.raises(ForwardpassError) as err:  # via the engine too: one error, nothing loaded
        LLM(tmp_path)
    assert err.value.param == param
