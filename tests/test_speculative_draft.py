"""Speculative decoding with a draft model (``method: draft_model``): greedy outputs equal decoding without
it, token for token, alone, in mixed batches and under preemption; the draft really runs, some drafts are
accepted and some rejected; every block of the target's pool and of the draft's own pool is free at the
end. The draft must share the target's tokenizer (refused otherwise, naming ``model``); the shipped draft of
the embedded model is found by name and is accepted most of the time on the model's held-out text."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from forwardpass import LLM, SamplingParams
from forwardpass.config import EngineConfig
from forwardpass.errors import ConfigError
from tests.helpers.checkpoints import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def draft_config(model, k: int = 3, **extra) -> dict:
    # always propose: the adaptive policy would (rightly) stop on a draft this poor
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k, "adaptive": False,
            "disable_by_batch_size": None, **extra}


def noisy_copy(src, dst, scale: float, seed: int = 1):
    """The target's checkpoint with noise on its last layer: a draft that agrees often but not always."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    for name, w in weights.items():
        if ".layers.2." in name and w.ndim == 2:
            weights[name] = w + scale * w.std() * torch.randn(w.shape, generator=g)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def models(checkpoint_factory, tmp_path_factory):
    target = checkpoint_factory("qwen3")
    return target, noisy_copy(target, tmp_path_factory.mktemp("draft") / "d", 0.3)


def outputs(llm, prompts, params=GREEDY):
    outs = llm.generate(prompts, params, use_tqdm=False)
    counts = sum(o.metrics.num_draft_tokens for o in outs), sum(o.metrics.num_accepted_tokens for o in outs)
    return [o.outputs[0].token_ids for o in outs], counts


def all_blocks_free(llm: LLM) -> None:
    llm.engine.check_invariants()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    cache = llm.engine.core.scheduler.speculator.proposer.cache
    assert cache.num_free_blocks == cache.num_blocks and not cache.sequences


def test_greedy_is_lossless(models):
    target, draft = models
    prompts = random_prompts(6, [9, 30, 17], seed=3)
    reference, _ = outputs(LLM(target, num_threads=1, num_kv_blocks=128), prompts)

    alone = LLM(target, num_threads=1, num_kv_blocks=128, max_num_seqs=1,
                speculative_config=draft_config(draft))
    tokens, (drafts, accepted) = outputs(alone, prompts[:3])
    assert tokens == reference[:3]
    assert 0 < accepted < drafts, (drafts, accepted)  # proposed, accepted and rejected
    assert alone.engine.core.scheduler.speculator.proposer.num_forwards >= drafts  # the draft model ran
    all_blocks_free(alone)

    # verifying sequences next to plain decode rows and newcomers' prefill chunks in one step
    mixed = LLM(target, num_threads=1, num_kv_blocks=128, max_num_seqs=3, max_num_batched_tokens=20,
                speculative_config=draft_config(draft, k=4))
    tokens, (drafts, accepted) = outputs(mixed, prompts)
    assert tokens == reference and 0 < accepted < drafts
    steps = list(mixed.engine.stats)
    assert any(r.acceptance_lengths and r.num_prefill_tokens for r in steps)
    all_blocks_free(mixed)


def test_lean_draft_step_is_the_models_forward(models):
    """The draft's lean forward (``draft_step.py``: decode rows through the decode stack on preallocated
    tables) gives the model's own logits: bitwise for a one-token step, to rounding for a 2-token catch-up
    (decode rows there, a prefill span in the model's path); the engine really takes it, stays lossless."""
    target, draft = models
    llm = LLM(target, num_threads=1, num_kv_blocks=64, cpu_kernels=True,
              speculative_config=draft_config(draft, quantization=None))
    proposer = llm.engine.core.scheduler.speculator.proposer
    assert proposer.stepper is not None
    cache, prompt = proposer.cache, [int(t) for t in torch.randint(3, 500, (40,), generator=torch.Generator()
                                                                    .manual_seed(0))]
    lean, plain = cache.sequence(1001), cache.sequence(1002)
    with torch.inference_mode():
        for state in (lean, plain):
            proposer._forward(state, prompt)
        for feed in ([7], [11], [19], [13, 17]):  # (after a catch-up the caches differ by rounding)
            stepper, proposer.stepper = proposer.stepper, None
            reference = proposer._forward(plain, feed)
            proposer.stepper = stepper
            before = proposer.num_lean
            got = proposer._forward(lean, feed)
            assert proposer.num_lean == before + 1
            if len(feed) == 1:
                assert torch.equal(got, reference), feed
            else:
                torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-4)
    for seq_id in (1001, 1002):
        cache.release(seq_id)

    prompts = random_prompts(2, [14], seed=7)
    reference, _ = outputs(LLM(target, num_threads=1, num_kv_blocks=64), prompts)
    tokens, (drafts, accepted) = outputs(llm, prompts)
    assert tokens == reference and 0 < accepted < drafts
    assert proposer.num_lean > proposer.num_forwards // 2  # every step but the prompts' catch-up
    all_blocks_free(llm)


def test_draft_quantization(models):
    """``quantization: auto`` (the default) loads an fp32 draft as int8 on CPU; None keeps it as stored.
    Either way the output is the target's."""
    from forwardpass.quant.weight import QuantizedWeight

    target, draft = models
    prompts = random_prompts(2, [10], seed=9)
    reference, _ = outputs(LLM(target, num_threads=1, num_kv_blocks=64), prompts)
    for quant in ("auto", None):
        llm = LLM(target, num_threads=1, num_kv_blocks=64, cpu_kernels=True,
                  speculative_config=draft_config(draft, quantization=quant))
        proposer = llm.engine.core.scheduler.speculator.proposer
        weight = proposer.model.model.layers[0].mlp.down_proj.weight
        assert isinstance(weight, QuantizedWeight) == (quant == "auto"), type(weight)
        tokens, (drafts, _) = outputs(llm, prompts)
        assert tokens == reference and drafts > 0 and proposer.num_lean > 0
        all_blocks_free(llm)


def test_sampled_tokens_keep_their_pinned_logprobs(models):
    """At temperature 1 a drafted token is accepted or resampled by the rejection rule (not the sampler), and
    still carries what the request asked for: its logprob and those of ``logprob_token_ids``. With every id of
    the vocabulary pinned, each position's pinned logprobs are a whole distribution (they sum to one) and the
    chosen token's own logprob is its pinned one: both come from the target's row for that position."""
    target, draft = models
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    llm = LLM(target, num_threads=1, num_kv_blocks=64, speculative_config=draft_config(draft))
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=16, ignore_eos=True, logprobs=0,
                            logprob_token_ids=list(range(vocab)))
    outs = llm.generate(random_prompts(2, [12], seed=4), params, use_tqdm=False)
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0  # some tokens came through the rule
    for out in outs:
        completion = out.outputs[0]
        assert len(completion.logprobs) == len(completion.token_ids)
        for token, position in zip(completion.token_ids, completion.logprobs):
            assert next(iter(position)) == token  # the chosen token's entry comes first, with its own logprob
            assert set(range(vocab)) <= set(position)
            total = torch.tensor([position[t].logprob for t in range(vocab)]).exp().sum().item()
            assert abs(total - 1.0) < 1e-4, total
    all_blocks_free(llm)


def test_preemption_mid_draft(models):
    """A pool too small for every sequence: sequences are preempted while they hold drafts (target blocks and
    draft-cache blocks both go back), are recomputed, and still give the reference tokens."""
    target, draft = models
    prompts = random_prompts(5, [40, 28], seed=11)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reference, _ = outputs(LLM(target, num_threads=1, num_kv_blocks=128), prompts, params)
    llm = LLM(target, num_threads=1, num_kv_blocks=14, block_size=16, max_num_seqs=5,
              speculative_config=draft_config(draft))
    released = []
    speculator = llm.engine.core.scheduler.speculator
    original = speculator.proposer.release
    speculator.proposer.release = lambda seq_id: (released.append(seq_id), original(seq_id))
    tokens, (drafts, accepted) = outputs(llm, prompts, params)
    assert tokens == reference
    assert llm.engine.core.scheduler.num_preemptions > 0 and 0 < accepted < drafts
    assert len(released) > len(prompts)  # each finish, and every preemption, gave the draft's blocks back
    all_blocks_free(llm)


def test_draft_of_another_architecture(models, checkpoint_factory):
    """Any model the engine loads can draft: a Llama draft (untied head, other shape) for a Qwen3 target."""
    target, _ = models
    draft = checkpoint_factory("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    prompts = random_prompts(2, [12], seed=5)
    reference, _ = outputs(LLM(target, num_threads=1, num_kv_blocks=64), prompts)
    llm = LLM(target, num_threads=1, num_kv_blocks=64, speculative_config=draft_config(draft))
    tokens, (drafts, _) = outputs(llm, prompts)
    assert tokens == reference and drafts > 0
    all_blocks_free(llm)


def test_config_errors_name_the_model(models, checkpoint_factory):
    target, _ = models
    with pytest.raises(ConfigError) as err:
        EngineConfig(speculative_config={"method": "draft_model"})
    assert err.value.param == "speculative_config.model"
    with pytest.raises(ConfigError) as err:
        EngineConfig(speculative_config={"method": "ngram", "model": "x"})
    assert err.value.param == "speculative_config.model"
    with pytest.raises(ConfigError) as err:
        EngineConfig(speculative_config={"method": "draft_model", "model": "x", "quantization": "fp8"})
    assert err.value.param == "speculative_config.quantization"
    other_vocab = checkpoint_factory("qwen3", vocab_size=600)
    with pytest.raises(ConfigError, match="vocabulary has 600 tokens, the target's 512") as err:
        LLM(target, num_threads=1, num_kv_blocks=32, speculative_config=draft_config(other_vocab))
    assert err.value.param == "speculative_config.model"


def test_tokenizers_must_match(tmp_path):
    """Same vocabulary size, other token ids: refused at start-up."""
    from forwardpass.assets import default_llm_path
    from forwardpass.engine.speculative.draft import check_same_tokenizer

    target = default_llm_path()
    same, other = tmp_path / "same", tmp_path / "other"
    for d in (same, other):
        d.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(target / name, d / name)
    check_same_tokenizer(target, same, 4096, 4096)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = (t for t, i in vocab.items() if i in (2048, 2049))
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ordinary tokens trade ids (one of the ids checked)
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConfigError, match="share the target's tokenizer") as err:
        check_same_tokenizer(target, other, 4096, 4096)
    assert err.value.param == "speculative_config.model"


def test_shipped_draft_of_the_embedded_model():
    """``forwardpass-default-draft`` drafts for ``forwardpass-default``: lossless, and its single drafts (k=1:
    the per-token agreement with the target's own greedy text) are accepted 54% of the time on these held-out
    passages (a random draft of this vocabulary: ~0%); the assets README reports the full benchmark."""
    from forwardpass.assets import default_llm_heldout_text_path

    text = default_llm_heldout_text_path().read_text(encoding="utf-8")
    prompts = [text[i : i + 300] for i in (1000, 50_000, 120_000)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = LLM(num_threads=1)
    reference = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(num_threads=1, speculative_config={"method": "draft_model", "num_speculative_tokens": 1,
                                                 "model": "forwardpass-default-draft", "adaptive": False})
    tokens, (drafts, accepted) = outputs(llm, prompts, params)
    assert tokens == reference
    assert drafts > 0 and accepted / drafts > 0.4, (drafts, accepted)
    all_blocks_free(llm)
