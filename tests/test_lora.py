"""LoRA adapters: parity with PEFT's merged model, mixed-adapter batches, the prefix cache keyed by
adapter, max_loras admission, clear errors, and the ``--lora`` CLI."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from forwardpass import LLM, LoRARequest, SamplingParams
from forwardpass.errors import ValidationError
from forwardpass.lora.adapter import LoRAAdapterError
from tests.helpers.checkpoints import random_prompts
from tests.helpers.oracle import hf_greedy, hf_model

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, use_rslora, seed)
ADAPTERS = {"r8": (8, 16, False, 1), "r16_rs": (16, 8, True, 2)}
NEW_TOKENS = 16


def make_adapter(base_path, directory, rank, alpha, rslora, seed, targets=TARGETS):
    """Save a PEFT adapter with random (non-zero) A and B; return the merged HF model (the oracle)."""
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False,
                          use_rslora=rslora, lora_dropout=0.0)
    model = peft.get_peft_model(hf_model(base_path), cfg)
    model.save_pretrained(directory)
    return model.merge_and_unload().eval()


@pytest.fixture(scope="module")
def base(checkpoint_factory):
    return checkpoint_factory("qwen3")


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    """name -> (LoRARequest, merged HF model)"""
    out = {}
    for i, (name, (rank, alpha, rslora, seed)) in enumerate(sorted(ADAPTERS.items()), start=1):
        d = tmp_path_factory.mktemp(f"lora_{name}")
        merged = make_adapter(base, d, rank, alpha, rslora, seed)
        out[name] = (LoRARequest(name, i, str(d)), merged)
    return out


@pytest.fixture(scope="module")
def llm(base):
    return LLM(base, enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=96, block_size=16)


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_matches_peft_merged_model(llm, adapters, name):
    request, merged = adapters[name]
    prompts = random_prompts(2, [57, 21], seed=10)
    outs = llm.generate(prompts, GREEDY, lora_request=request, use_tqdm=False)
    base_outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out, base_out in zip(prompts, outs, base_outs):
        assert out.outputs[0].token_ids == hf_greedy(merged, prompt, NEW_TOKENS), name
        assert out.outputs[0].token_ids != base_out.outputs[0].token_ids  # the adapter matters
    llm.engine.check_invariants()

    # logits of every prefill row (adapter applied through the engine's row mapping) vs merged weights
    prompt = prompts[0]
    model, manager = llm.engine.model, llm.engine.lora_manager
    with torch.no_grad():
        ref = merged(torch.tensor([prompt])).logits[0]
    with torch.inference_mode():
        manager.batch.groups = [(request.lora_int_id, slice(0, len(prompt)))]
        try:
            ours = model.compute_logits(model(torch.tensor(prompt), torch.arange(len(prompt))))
        finally:
            manager.end_step()
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    # and the engine's own path on the last position, through logprobs
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=10),
                       lora_request=request, use_tqdm=False)[0]
    ref_lp = torch.log_softmax(ref[-1], -1)
    for tid, lp in out.outputs[0].logprobs[0].items():
        assert abs(lp.logprob - ref_lp[tid].item()) < 1e-4


def test_mixed_batch_equals_each_alone(llm, adapters):
    a, b = adapters["r8"][0], adapters["r16_rs"][0]
    prompts = random_prompts(6, [33, 20, 61, 45, 27, 38], seed=11)
    loras = [a, None, b, a, None, b]
    seen = []
    manager = llm.engine.lora_manager
    original = manager.begin_step

    def spy(row_adapters):  # the runner's per-step call: (adapter id or 0, rows) per scheduled chunk
        original(row_adapters)
        seen.append(({aid for aid, _ in manager.batch.groups}, sum(aid == 0 for aid, _ in row_adapters)))

    manager.begin_step = spy
    try:
        together = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, lora_request=loras,
                                                                 use_tqdm=False)]
    finally:
        del manager.begin_step
    assert any(ids == {a.lora_int_id, b.lora_int_id} and n_base > 0 for ids, n_base in seen), seen
    alone = [llm.generate([p], GREEDY, lora_request=lr, use_tqdm=False)[0].outputs[0].token_ids
             for p, lr in zip(prompts, loras)]
    assert together == alone
    assert together[0] != together[1] or together[2] != together[1]
    llm.engine.check_invariants()


def test_prefix_cache_is_keyed_by_adapter(llm, adapters):
    a, b = adapters["r8"][0], adapters["r16_rs"][0]
    prompt = random_prompts(1, [50], seed=12)[0]  # 3 full blocks of 16
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def run(lora):
        out = llm.generate([prompt], params, lora_request=lora, use_tqdm=False)[0]
        return out.num_cached_tokens, out.outputs[0].token_ids

    _, toks_a1 = run(a)
    cached_b, toks_b = run(b)
    cached_base, toks_base = run(None)
    cached_a2, toks_a2 = run(a)
    assert cached_b == 0 and cached_base == 0  # same tokens, other adapter: other K/V
    assert cached_a2 == 48 and toks_a2 == toks_a1  # same adapter: served from the cache, same result
    assert len({tuple(toks_a1), tuple(toks_b), tuple(toks_base)}) == 3


def test_max_loras_bounds_adapters_per_batch(base, adapters):
    a, b = adapters["r8"][0], adapters["r16_rs"][0]
    llm = LLM(base, enable_lora=True, max_loras=1, max_lora_rank=16, num_kv_blocks=64)
    seen = []
    manager = llm.engine.lora_manager
    original = manager.begin_step

    def spy(row_adapters):
        original(row_adapters)
        seen.append({aid for aid, _ in row_adapters if aid})

    manager.begin_step = spy
    prompts = random_prompts(4, [25, 30, 22, 28], seed=13)
    loras = [a, b, None, a]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras, use_tqdm=False)]
    assert seen and all(len(s) <= 1 for s in seen)
    del manager.begin_step
    alone = [llm.generate([p], params, lora_request=lr, use_tqdm=False)[0].outputs[0].token_ids
             for p, lr in zip(prompts, loras)]
    assert outs == alone
    llm.engine.check_invariants()


# ----- errors -------------------------------------------------------------------------------------
def _edited_copy(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_clear_errors(base, llm, adapters, tmp_path, checkpoint_factory):
    src = adapters["r16_rs"][0].lora_path
    from pathlib import Path

    src = Path(src)
    engine = llm.engine

    def refused(path, match, lora_id=50):
        with pytest.raises(LoRAAdapterError, match=match):
            llm.generate([[5, 6, 7]], GREEDY, lora_request=LoRARequest("bad", lora_id, str(path)),
                         use_tqdm=False)

    small = LLM(base, enable_lora=True, max_lora_rank=8, num_kv_blocks=16)
    with pytest.raises(LoRAAdapterError, match="max_lora_rank=8"):
        small.generate([[5, 6, 7]], GREEDY, lora_request=adapters["r16_rs"][0], use_tqdm=False)
    refused(_edited_copy(src, tmp_path / "dora", use_dora=True), "DoRA")
    refused(_edited_copy(src, tmp_path / "mts", modules_to_save=["lm_head"]), "modules_to_save")
    refused(_edited_copy(src, tmp_path / "tgt", target_modules=["q_proj", "query_key_value"]),
            "query_key_value")
    refused(tmp_path / "nowhere", "not a directory")
    # logits are computed from the LM head's weight directly: an adapter there would be
    # ignored, so it is refused
    head = tmp_path / "head_adapter"
    make_adapter(base, head, 8, 16, False, 4, targets=["q_proj", "lm_head"])
    refused(head, "lm_head")
    # an adapter made for another architecture / shape (Llama with head_dim 16 vs Qwen3 with 32)
    other = tmp_path / "llama_adapter"
    make_adapter(checkpoint_factory("llama"), other, 8, 16, False, 3)
    refused(other, "LlamaForCausalLM")
    cfg = json.loads((other / "adapter_config.json").read_text())
    cfg.pop("auto_mapping", None)
    (other / "adapter_config.json").write_text(json.dumps(cfg))
    refused(other, "another shape")
    # the same id for a different adapter
    engine.add_lora(adapters["r8"][0])
    with pytest.raises(LoRAAdapterError, match="already names"):
        llm.generate([[5, 6, 7]], GREEDY, lora_request=LoRARequest("r8", 2, str(src)), use_tqdm=False)
    # an engine without LoRA refuses LoRA requests
    plain = LLM(base, num_kv_blocks=16)
    with pytest.raises(ValidationError, match="enable_lora"):
        plain.generate([[5, 6, 7]], GREEDY, lora_request=adapters["r8"][0], use_tqdm=False)
    with pytest.raises(ValidationError):
        LoRARequest("x", 0, "/tmp")
    engine.check_invariants()
    assert not engine.has_unfinished_requests()


# ----- CLI ----------------------------------------------------------------------------------------
def test_parse_lora_specs():
    from forwardpass.lora.cli import parse_lora_specs

    reqs = parse_lora_specs(["a=/x/y", "b = /z"])
    assert (reqs["a"] == LoRARequest("a", 1, "/x/y") and reqs["b"].lora_int_id == 2
            and reqs["b"].lora_path == "/z")
    for bad in (["a"], ["=p"], ["a=p", "a=q"]):
        with pytest.raises(LoRAAdapterError):
            parse_lora_specs(bad)


def test_generate_cli_with_lora(base, adapters, tmp_path, capsys):
    from forwardpass.cli import main
    from tests.helpers.moe_checkpoints import copy_with_tokenizer

    model = copy_with_tokenizer(base, tmp_path / "model")
    a, b = adapters["r8"][0], adapters["r16_rs"][0]
    common = ["generate", "once upon a time", "--model", str(model), "--max-tokens", "6", "--temperature",
              "0", "--ignore-eos"]
    assert main(common) == 0
    plain = capsys.readouterr().out
    assert main([*common, "--lora", f"a={a.lora_path}", "--lora", f"b={b.lora_path}"]) == 0
    out = capsys.readouterr().out
    assert "[a]" in out and "[b]" in out and out != plain
    assert main([*common, "--lora", "broken"]) == 1
    assert "NAME=PATH" in capsys.readouterr().err


def test_lora_on_moe_model(tmp_path_factory):
    """An attention adapter on a Qwen3-MoE matches PEFT's merged model; an adapter on the experts (PEFT
    turns gate/up/down targets into ``target_parameters`` on the fused expert tensors) is refused."""
    from tests.helpers.moe_checkpoints import make_moe_checkpoint

    base = make_moe_checkpoint(tmp_path_factory.mktemp("moe_base"), "qwen3_moe_k2_norm")
    d = tmp_path_factory.mktemp("moe_lora")
    merged = make_adapter(base, d, 8, 16, False, 4, targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    llm = LLM(base, enable_lora=True, max_lora_rank=8, num_kv_blocks=32)
    request = LoRARequest("moe", 1, str(d))
    prompts = random_prompts(2, [40, 19], seed=14)
    outs = llm.generate(prompts, GREEDY, lora_request=request, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(merged, prompt, NEW_TOKENS)

    experts = tmp_path_factory.mktemp("moe_expert_lora")
    make_adapter(base, experts, 4, 8, False, 5, targets=["q_proj", "gate_proj", "up_proj", "down_proj"])
    with pytest.raises(LoRAAdapterError, match="target_parameters"):
        llm.generate(prompts, GREEDY, lora_request=LoRARequest("experts", 2, str(experts)), use_tqdm=False)
    llm.engine.check_invariants()


def test_an_adapter_that_cannot_be_reloaded_fails_only_its_requests(base, adapters, tmp_path):
    """An adapter evicted from memory whose files were deleted since: the step runs without its rows,
    its request fails with the reason, and the requests beside it get exactly their tokens alone."""
    from forwardpass.errors import ForwardpassError

    doomed_dir = tmp_path / "doomed"
    shutil.copytree(adapters["r8"][0].lora_path, doomed_dir)
    doomed, good = LoRARequest("doomed", 7, str(doomed_dir)), adapters["r16_rs"][0]
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=64)
    prompts = random_prompts(3, [20, 30, 25], seed=12)
    alone = {"base": llm.generate([prompts[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids,
             "good": llm.generate([prompts[2]], GREEDY, lora_request=good,
                                  use_tqdm=False)[0].outputs[0].token_ids}
    engine = llm.engine
    engine.add_request("base", prompts[0], GREEDY)
    engine.add_request("doomed", prompts[1], GREEDY, lora_request=doomed)  # validated and loaded here
    engine.add_request("good", prompts[2], GREEDY, lora_request=good)
    engine.lora_manager._uninstall(7)  # evicted while queued, as the LRU policy does under pressure ...
    shutil.rmtree(doomed_dir)  # ... and its files are gone before its first step
    finished, errors = {}, []
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except ForwardpassError as exc:
            errors.append(str(exc))
            continue
        finished.update({o.request_id: o.outputs[0].token_ids for o in outs if o.finished})
    assert len(errors) == 1 and "'doomed'" in errors[0] and "could not be reloaded" in errors[0], errors
    assert finished == alone
    engine.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
