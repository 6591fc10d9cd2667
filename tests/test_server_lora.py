"""``forwardpass serve --lora NAME=PATH``: each adapter is a model name; its requests run with it."""

from __future__ import annotations

import pytest

from tests.helpers.server import ServerProcess, make_served_model

openai = pytest.importorskip("openai")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(180)
PROMPT = [5, 17, 99, 200, 31, 8]


@pytest.fixture(scope="module")
def setup(checkpoint_factory, tmp_path_factory):
    import torch

    base = checkpoint_factory("qwen3")
    adapter = tmp_path_factory.mktemp("lora_a")
    torch.manual_seed(1)
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                          init_lora_weights=False, lora_dropout=0.0)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft.get_peft_model(model, cfg).save_pretrained(adapter)
    served = make_served_model(tmp_path_factory.mktemp("served"), base)
    with ServerProcess(served, "--num-kv-blocks", "128", "--lora", f"adapter-a={adapter}") as srv:
        yield srv, served, adapter


def test_adapters_are_models_and_run_with_their_weights(setup):
    from forwardpass import LLM, LoRARequest, SamplingParams

    srv, model_dir, adapter = setup
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["test-model", "adapter-a"]
    kw = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "extra_body": {"ignore_eos": True}}
    served = {m: client.completions.create(model=m, logprobs=0, **kw).choices[0].logprobs.tokens
              for m in ("test-model", "adapter-a")}
    llm = LLM(model_dir, num_kv_blocks=64, enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    lora = LoRARequest("adapter-a", 1, str(adapter))
    for name, req in (("test-model", None), ("adapter-a", lora)):
        out = llm.generate([PROMPT], params, lora_request=req, use_tqdm=False)[0].outputs[0]
        tokens = [next(iter(d.values())).decoded_token for d in out.logprobs]
        assert served[name] == tokens, name
    assert served["test-model"] != served["adapter-a"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="adapter-b", **kw)
