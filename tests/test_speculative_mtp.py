"""``speculative_config={"method": "mtp"}``: DeepSeek-V3's next-token-prediction layer proposes the drafts.

Lossless (greedy tokens equal to decoding without speculation, alone, in mixed batches and under forced
preemption, every block of both pools free at the end); the drafts are the MTP layer's, computed right
(equal to a plain-PyTorch reference built on transformers' own decoder layer); sampled requests draw their
drafts from the layer's ``q`` for the full rejection rule; checkpoints without the layer are refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from forwardpass import LLM, SamplingParams
from forwardpass.errors import ConfigError
from tests.helpers.checkpoints import random_prompts
from tests.helpers.mtp_checkpoints import make_donor, make_mtp_checkpoint
from tests.test_speculative import copy_heavy_prompts, spec_counts, token_ids

MTP = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False, "disable_by_batch_size": None}
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    """Random weights: the layer's drafts are nearly always rejected."""
    return make_mtp_checkpoint(tmp_path_factory.mktemp("mtp"))


@pytest.fixture(scope="module")
def agreeing_model(tmp_path_factory):
    """Only two tokens can come out (the other LM-head rows are zero) and the MTP layer shares the head: its
    drafts are often accepted, often not."""
    return make_mtp_checkpoint(tmp_path_factory.mktemp("mtp_agree"), own_head=False, live_rows=2)


def proposer(llm: LLM):
    return llm.engine.core.scheduler.speculator.proposer


def all_free(llm: LLM) -> None:
    llm.engine.check_invariants()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    p = proposer(llm)
    assert p.cache.num_free_blocks == p.cache.num_blocks and not p.cache.sequences and not p.stash.runs


@pytest.mark.parametrize("which", ["mtp_model", "agreeing_model"])
def test_greedy_is_lossless(which, request):
    path = request.getfixturevalue(which)
    prompts = copy_heavy_prompts(4) + random_prompts(1, [45], seed=3)
    plain = LLM(path, num_kv_blocks=128, num_threads=1)
    reference = token_ids(plain.generate(prompts, GREEDY, use_tqdm=False))

    alone = LLM(path, num_kv_blocks=128, num_threads=1, max_num_seqs=1, speculative_config=MTP)
    outs = alone.generate(prompts[:3], GREEDY, use_tqdm=False)
    assert token_ids(outs) == reference[:3]
    drafts, accepted = spec_counts(outs)
    assert drafts > 0 and proposer(alone).num_forwards > 0
    if which == "agreeing_model":
        assert 0 < accepted < drafts, (drafts, accepted)  # accepted and rejected
    assert proposer(alone).stash.num_missing == 0  # every position's hidden state came from the target
    all_free(alone)

    # verifying sequences next to plain decode rows and newcomers' prefill chunks in one forward pass
    mixed = LLM(path, num_kv_blocks=128, num_threads=1, max_num_seqs=3, max_num_batched_tokens=24,
                speculative_config=MTP)
    outs = mixed.generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(outs) == reference
    assert any(r.acceptance_lengths and r.num_prefill_tokens for r in mixed.engine.stats)
    all_free(mixed)

    # preemption mid-draft: a KV cache far too small for the batch
    tiny = LLM(path, num_kv_blocks=14, num_threads=1, max_model_len=96, speculative_config=MTP)
    outs = tiny.generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(outs) == reference
    assert tiny.engine.core.scheduler.num_preemptions > 0
    assert any(o.metrics.num_preemptions and o.metrics.num_draft_tokens for o in outs)
    all_free(tiny)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@torch.no_grad()
def reference_drafts(path, tokens: list[int], k: int) -> tuple[list[int], list[float]]:
    """The MTP layer's ``k`` drafts after ``tokens``, in plain PyTorch around transformers' decoder layer, the
    whole sequence recomputed for each draft; and each draft's top-1 / top-2 logit margin."""
    import transformers

    target = transformers.DeepseekV3ForCausalLM.from_pretrained(path).eval()
    cfg = json.loads((path / "config.json").read_text())
    n, eps = cfg["num_hidden_layers"], cfg["rms_norm_eps"]
    donor = make_donor(n)
    pre = f"model.layers.{n}."
    w = {k[len(pre):]: v for k, v in load_file(next(path.glob("*.safetensors"))).items() if k.startswith(pre)}
    layer = donor.model.layers[n]
    layer.load_state_dict({k: v for k, v in w.items() if k in layer.state_dict()})
    h = target.model(torch.tensor([tokens])).last_hidden_state[0]  # after the final norm
    nxt, prev = list(tokens[1:]), h[:-1]  # position i: t_{i+1} and h_i
    drafts, margins = [], []
    for _ in range(k):
        e = w["embed_tokens.weight"][torch.tensor(nxt)]
        x = torch.cat([_rms(e, w["enorm.weight"], eps), _rms(prev, w["hnorm.weight"], eps)], -1)
        x = x @ w["eh_proj.weight"].T
        pos = torch.arange(len(nxt))[None]
        out = layer(x[None], attention_mask=None, position_ids=pos,
                    position_embeddings=donor.model.rotary_emb(x[None], pos))
        out = (out[0] if isinstance(out, tuple) else out)[0]
        logits = _rms(out[-1], w["shared_head.norm.weight"], eps) @ w["shared_head.head.weight"].T
        top = logits.topk(2).values
        drafts.append(int(logits.argmax()))
        margins.append(float(top[0] - top[1]))
        nxt.append(drafts[-1])
        prev = torch.cat([prev, out[-1:]])  # the next position reads the layer's own output
    return drafts, margins


def test_drafts_are_the_mtp_layers(mtp_model):
    """Each proposal equals the reference's (where the reference's top two logits are not a near-tie)."""
    llm = LLM(mtp_model, num_kv_blocks=128, num_threads=1, max_num_seqs=1, speculative_config=MTP)
    p = proposer(llm)
    calls = []
    propose = p.propose_for

    def spy(seq, k):
        drafts = propose(seq, k)
        calls.append((list(seq.token_ids), list(drafts)))
        return drafts

    p.propose_for = spy
    llm.generate(copy_heavy_prompts(2), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    compared = 0
    for tokens, drafts in calls[::2]:
        want, margins = reference_drafts(mtp_model, tokens, len(drafts))
        for got, ref, margin in zip(drafts, want, margins):
            if margin < 1e-3:
                break  # a near-tie: float rounding may choose either, and the chain goes on from it
            assert got == ref, (tokens, drafts, want)
            compared += 1
    assert compared >= 8, compared


def test_sampled_requests_draw_from_q(agreeing_model):
    """temperature > 0: drafts come with the layer's distribution ``q`` (the full rejection rule applies)."""
    llm = LLM(agreeing_model, num_kv_blocks=128, num_threads=1, max_num_seqs=1, speculative_config=MTP)
    p = proposer(llm)
    seen = []
    propose = p.propose_for
    p.propose_for = lambda seq, k: seen.append(propose(seq, k)) or seen[-1]
    params = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=5)
    outs = llm.generate(copy_heavy_prompts(2), params, use_tqdm=False)
    drafts, accepted = spec_counts(outs)
    assert drafts > 0 and accepted > 0
    with_q = [d for d in seen if d]
    assert with_q and all(d.probs is not None and d.probs.shape[0] == len(d) for d in with_q)
    for d in with_q:
        assert torch.allclose(d.probs.sum(-1), torch.ones(len(d)), atol=1e-5)
        assert all(float(d.probs[i, t]) > 0 for i, t in enumerate(d))  # each draft drawn from its q
    # seeded: the same tokens again (the layer's draws have a generator of their own)
    again = LLM(agreeing_model, num_kv_blocks=128, num_threads=1, max_num_seqs=1, speculative_config=MTP)
    assert token_ids(again.generate(copy_heavy_prompts(2), params, use_tqdm=False)) == token_ids(outs)
    all_free(llm)


def test_checkpoints_without_the_layer_are_refused(tmp_path, checkpoint_factory):
    from tests.helpers.attention_checkpoints import make_attention_checkpoint

    none = make_attention_checkpoint(tmp_path / "none", "deepseek_v3", num_nextn_predict_layers=0)
    no_layers = r"no next-token-prediction layers \(num_nextn_predict_layers = 0\)"
    with pytest.raises(ConfigError, match=no_layers) as err:
        LLM(none, num_kv_blocks=64, speculative_config=MTP)
    assert err.value.param == "speculative_config.method"
    # config.json says 1, as transformers writes it, but the tensors were dropped
    dropped = make_attention_checkpoint(tmp_path / "dropped", "deepseek_v3")
    with pytest.raises(ConfigError, match=r"no model\.layers\.3\.\* tensors"):
        LLM(dropped, num_kv_blocks=64, speculative_config=MTP)
    with pytest.raises(ConfigError, match="num_nextn_predict_layers = 0"):
        LLM(checkpoint_factory("qwen3"), num_kv_blocks=64, speculative_config=MTP)
    with pytest.raises(ConfigError, match="speculative_config.model applies to method draft_model"):
        LLM(checkpoint_factory("qwen3"), speculative_config={**MTP, "model": "x"})
