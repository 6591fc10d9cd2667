"""Whisper in the engine: greedy tokens equal transformers' on random-weight checkpoints (80 mels with
the released 30 s window, 128 mels with a 2 s window), batched clips of different lengths, a string
prompt, resampled input, chunked prefill and preemption (the encoder runs again), the cross-attention
slot's lifecycle, and the errors a request without (or with misplaced) audio gets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from forwardpass import LLM, SamplingParams
from forwardpass.audio import log_mel_spectrogram, resample
from forwardpass.engine.scheduling.cross_attention_spec import CrossAttentionSpec
from forwardpass.engine.scheduling.kv_cache_spec import FullAttentionSpec, layer_specs
from forwardpass.errors import ValidationError
from forwardpass.models.model_spec import load_model_spec
from tests.helpers.whisper_checkpoints import (
    PROMPT_TEXT,
    hf_greedy,
    make_clip,
    make_whisper_checkpoint,
    prompt_ids,
)

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
CONFIGS = {"mel80_30s": (80, 1500), "mel128_2s": (128, 100)}


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    """(checkpoint dir, transformers model, engine) per config, built once."""
    cache: dict = {}

    def get(name):
        if name not in cache:
            mels, positions = CONFIGS[name]
            d = make_whisper_checkpoint(tmp_path_factory.mktemp(name), mels, positions, seed=len(cache))
            hf = transformers.WhisperForConditionalGeneration.from_pretrained(d).eval()
            cache[name] = (d, hf, LLM(str(d), max_num_seqs=4, num_kv_blocks=64))
        return cache[name]

    return get


def _expected(hf, clip, mels, positions, prompt, n=GREEDY.max_tokens):
    return hf_greedy(hf, log_mel_spectrogram(clip, mels, 2 * positions), prompt, n)


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_clips_match_transformers(whisper, name):
    d, hf, llm = whisper(name)
    mels, positions = CONFIGS[name]
    window = 2 * positions / 100
    prompt = prompt_ids(d)
    # shorter than, close to, and longer than the encoder's window (trimmed, as Whisper does)
    clips = [make_clip(s, i) for i, s in enumerate([0.4, window * 0.9, window + 1.5])]
    outs = llm.generate(
        [{"prompt_token_ids": prompt, "multi_modal_data": {"audio": (c, 16_000)}} for c in clips],
        GREEDY,
        use_tqdm=False,
    )
    want = [_expected(hf, c, mels, positions, prompt) for c in clips]
    assert _tokens(outs) == want
    assert len({tuple(w) for w in want}) > 1, "different clips should give different tokens (audio is heard)"
    llm.engine.check_invariants()


def test_string_prompt_and_other_sample_rate(whisper):
    d, hf, llm = whisper("mel128_2s")
    prompt = prompt_ids(d)
    assert llm.get_tokenizer().encode(PROMPT_TEXT) == prompt  # the special tokens are single ids
    clip_8k = make_clip(1.2, 7, rate=8_000)
    out = llm.generate(
        {"prompt": PROMPT_TEXT, "multi_modal_data": {"audio": (clip_8k, 8_000)}}, GREEDY, use_tqdm=False
    )
    assert _tokens(out) == [_expected(hf, resample(clip_8k, 8_000), 128, 100, prompt)]


def test_chunked_prefill_and_preemption_rerun_the_encoder(whisper, tmp_path):
    d, hf, _ = whisper("mel128_2s")
    prompt = prompt_ids(d) + list(range(40, 60))  # a long decoder prompt: several prefill chunks
    clips = [make_clip(1.0 + 0.3 * i, 20 + i) for i in range(3)]
    want = [_expected(hf, c, 128, 100, prompt, 12) for c in clips]
    # 8 tokens per step: chunked prefill; 9 blocks of 4 tokens: three 36-token sequences cannot all fit
    llm = LLM(str(d), max_num_seqs=3, max_num_batched_tokens=8, block_size=4, num_kv_blocks=20)
    outs = llm.generate(
        [{"prompt_token_ids": prompt, "multi_modal_data": {"audio": (c, 16_000)}} for c in clips],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    assert _tokens(outs) == want
    assert llm.engine.scheduler.num_preemptions > 0, "the test must force a preemption"
    llm.engine.check_invariants()


def test_cross_attention_slot_per_request(whisper):
    d, _, llm = whisper("mel128_2s")
    spec = load_model_spec(d)
    specs = layer_specs(spec, 16, torch.float32)
    assert all(isinstance(s, FullAttentionSpec) for s in specs[: spec.layers])
    cross = specs[spec.layers :]
    assert all(isinstance(s, CrossAttentionSpec) for s in cross) and len(cross) == spec.layers
    assert cross[0].cache_shape(3) == (3, 2, 100, spec.heads, spec.head_dim)
    assert cross[0].blocks_needed(1) == cross[0].blocks_needed(10_000) == 1  # fixed size, whatever the length
    kv = llm.engine.kv
    g = next(i for i, grp in enumerate(kv.groups) if isinstance(grp.spec, CrossAttentionSpec))
    assert kv.groups[g].num_blocks == 4  # max_num_seqs slots
    assert not kv.enable_prefix_caching  # same decoder prompt, different audio: no prefix reuse
    assert kv.pools[g].num_free == 4


def test_requests_without_audio_or_with_bad_audio_are_refused(whisper, checkpoint_factory):
    d, _, llm = whisper("mel128_2s")
    prompt = prompt_ids(d)
    with pytest.raises(ValidationError) as err:
        llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
    assert err.value.param == "multi_modal_data"
    with pytest.raises(ValidationError, match="sample rate"):
        llm.generate(
            {"prompt_token_ids": prompt, "multi_modal_data": {"audio": (np.zeros(10), 0)}},
            GREEDY,
            use_tqdm=False,
        )
    with pytest.raises(ValidationError, match="NaN"):
        llm.generate(
            {"prompt_token_ids": prompt, "multi_modal_data": {"audio": (np.full(100, np.nan), 16_000)}},
            GREEDY,
            use_tqdm=False,
        )
    llm.engine.check_invariants()
    decoder = LLM(str(checkpoint_factory("qwen3")), max_num_seqs=2)
    with pytest.raises(ValidationError) as err:
        decoder.generate(
            {"prompt_token_ids": [5, 6], "multi_modal_data": {"audio": (np.zeros(160), 16_000)}},
            GREEDY,
            use_tqdm=False,
        )
    assert err.value.param == "multi_modal_data"


def test_max_num_seqs_lowered_to_the_requests_a_kv_budget_holds(whisper):
    """Each request's cross-attention K/V is paid first from the KV budget; where the configured batch of
    requests would leave no room for one full decoder sequence, fewer run at once (the most that leave it)
    instead of the engine refusing to start: ``forwardpass serve --model tiny.en`` with the defaults."""
    from forwardpass.errors import ConfigError

    d, hf, _ = whisper("mel80_30s")
    spec = load_model_spec(d)
    specs = [s for s in layer_specs(spec, 16, torch.float32) if s is not None]
    state = sum(s.page_bytes_per_layer for s in specs if isinstance(s, CrossAttentionSpec))
    page = sum(s.page_bytes_per_layer for s in specs if isinstance(s, FullAttentionSpec))
    blocks = -(-spec.max_position_embeddings // 16)  # one sequence of max_model_len tokens
    budget = 5 * state + blocks * page + page // 2  # five requests and one sequence, not six
    llm = LLM(str(d), kv_cache_memory=budget)  # max_num_seqs left at its default (64)
    assert llm.engine.config.max_num_seqs == 5
    kv = llm.engine.kv
    cross = next(g for g in kv.groups if isinstance(g.spec, CrossAttentionSpec))
    paged = next(g for g in kv.groups if isinstance(g.spec, FullAttentionSpec))
    assert cross.num_blocks == 5 and paged.num_blocks == blocks
    prompt, (mels, positions) = prompt_ids(d), CONFIGS["mel80_30s"]
    clips = [make_clip(1.0 + i, i) for i in range(7)]  # more requests than slots: they queue
    outs = llm.generate([{"prompt_token_ids": prompt, "multi_modal_data": {"audio": (c, 16_000)}}
                         for c in clips], GREEDY, use_tqdm=False)
    assert _tokens(outs) == [_expected(hf, c, mels, positions, prompt) for c in clips]
    llm.engine.check_invariants()
    with pytest.raises(ConfigError, match="kv_cache_memory"):  # not even one request: refused, as before
        LLM(str(d), kv_cache_memory=state + page)
