"""Structured output (xgrammar): every constraint form, validated on real-world schemas with the embedded
model.

The embedded model (forwardpass/assets/llm) was never taught JSON: at temperature >= 0.7 whatever it writes
is the grammar's doing, so every completed output must parse and validate. ``max_tokens`` truncation is
reported as ``finish_reason == "length"`` (and then the text need not be complete). Through the Python API
here; through the official ``openai`` client against a real server in ``test_server_structured.py``.
"""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
import torch

from forwardpass import LLM
from forwardpass.errors import SamplingParamsError
from forwardpass.sampling.params import SamplingParams
from forwardpass.sampling.sampler import Sampler, SamplingRow, apply_token_bitmask
from forwardpass.structured.params import StructuredOutputsParams

# ----- real-world schemas: nesting, enums, bounded arrays, $ref, patterns, numbers with bounds ----------
ADDRESS = {"type": "object", "properties": {
    "street": {"type": "string", "maxLength": 40}, "city": {"type": "string", "maxLength": 30},
    "postcode": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["street", "city", "postcode"],
    "additionalProperties": False}
SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.(com|org)$"},
        "address": ADDRESS}, "required": ["name", "age", "address"], "additionalProperties": False},
    "order_with_refs": {"type": "object", "$defs": {"item": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
        "price": {"type": "number", "minimum": 0}}, "required": ["sku", "quantity", "price"],
        "additionalProperties": False}},
        "properties": {"id": {"type": "integer"},
                       "items": {"type": "array", "items": {"$ref": "#/$defs/item"},
                                                             "minItems": 1, "maxItems": 3},
                       "status": {"enum": ["pending", "shipped", "delivered"]}},
        "required": ["id", "items", "status"], "additionalProperties": False},
    "event_tags": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 25},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["work", "home", "urgent", "later"]},
                 "minItems": 2, "maxItems": 4},
        "priority": {"type": "integer", "enum": [1, 2, 3]}, "done": {"type": "boolean"},
        "notes": {"anyOf": [{"type": "string", "maxLength": 20}, {"type": "null"}]}},
        "required": ["title", "tags", "priority", "done", "notes"], "additionalProperties": False},
    "weather_tool_args": {"type": "object", "properties": {
        "location": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["location", "unit"],
        "additionalProperties": False},
    "tree": {"$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer", "minimum": -9, "maximum": 9},
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
        "required": ["value", "children"], "additionalProperties": False}}, "$ref": "#/$defs/node"},
}


@pytest.fixture(scope="module")
def llm():
    return LLM(None, num_kv_blocks=256, seed=0)


def _params(so: dict | StructuredOutputsParams, **kw) -> SamplingParams:
    return SamplingParams(structured_outputs=so, **{"temperature": 0.8, "max_tokens": 300, **kw})


# ----- JSON schemas ------------------------------------------------------------------------------------
def test_json_schemas_validate_at_high_temperature(llm):
    names = list(SCHEMAS)
    outs = llm.generate(["The letter said"] * len(names),
                        [_params({"json": SCHEMAS[k], "disable_any_whitespace": True}, n=3, seed=i)
                         for i, k in enumerate(names)], use_tqdm=False)
    completed = 0
    for name, out in zip(names, outs):
        for c in out.outputs:
            assert c.finish_reason in ("stop", "length"), (name, c.finish_reason)
            if c.finish_reason == "length":
                continue
            jsonschema.validate(json.loads(c.text), SCHEMAS[name])
            completed += 1
    assert completed >= len(names) * 3 * 0.6, f"only {completed} outputs completed before max_tokens"


def test_json_schema_with_free_whitespace_and_json_object(llm):
    outs = llm.generate(["Mr. Darcy", "Elizabeth"], [
        _params({"json": SCHEMAS["weather_tool_args"]}, n=2, seed=1),
        _params({"json_object": True}, n=2, seed=2, max_tokens=200)], use_tqdm=False)
    for c in outs[0].outputs:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), SCHEMAS["weather_tool_args"])
    for c in outs[1].outputs:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)


def test_max_tokens_truncation_is_length(llm):
    out = llm.generate("x", _params({"json": SCHEMAS["person"]}, max_tokens=5, seed=3), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 5
    assert c.text.startswith("{")


# ----- regex, choice, grammar: exact -------------------------------------------------------------------
def test_regex_and_choice_are_exact(llm):
    regex = r"[A-Z][a-z]{2,8} (Bennet|Darcy), [0-9]{2}"
    choices = ["Pride", "Prejudice", "Sense and Sensibility", 'a "quoted" choice']
    outs = llm.generate(["She", "Her favourite book is"], [
        _params({"regex": regex}, n=4, seed=4), _params({"choice": choices}, n=6, seed=5)], use_tqdm=False)
    for c in outs[0].outputs:
        assert c.finish_reason == "stop" and re.fullmatch(regex, c.text), c.text
    for c in outs[1].outputs:
        assert c.finish_reason == "stop" and c.text in choices, c.text


def test_ebnf_grammar(llm):
    grammar = 'root ::= "(" expr ")"\nexpr ::= num (("+" | "*") num)*\nnum ::= [1-9] [0-9]?'
    out = llm.generate("Sum:", _params({"grammar": grammar}, n=3, seed=6, max_tokens=60), use_tqdm=False)[0]
    for c in out.outputs:
        if c.finish_reason == "stop":
            assert re.fullmatch(r"\([1-9][0-9]?([+*][1-9][0-9]?)*\)", c.text), c.text


# ----- batching, chunked prefill, preemption ----------------------------------------------------------
def test_mixed_batch_equals_each_alone(llm):
    free = SamplingParams(temperature=0.8, seed=11, max_tokens=30)
    constrained = _params({"json": SCHEMAS["weather_tool_args"]}, seed=12, max_tokens=80)
    choice = _params({"choice": ["yes", "no", "perhaps"]}, seed=13)
    prompts = ["It is a truth", "Emma", "Mr. Knightley"]
    together = llm.generate(prompts, [free, constrained, choice], use_tqdm=False)
    alone = [llm.generate(p, sp, use_tqdm=False)[0] for p, sp in zip(prompts, [free, constrained, choice])]
    for a, b in zip(together, alone):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_chunked_prefill_and_preemption_keep_the_grammar():
    # A tiny KV pool and chunk budget: prompts are computed in chunks and sequences get preempted.
    small = LLM(None, num_kv_blocks=12, block_size=16, max_model_len=160, max_num_batched_tokens=32,
                max_num_seqs=8, seed=0)
    regex = r"[a-z]{3,6}( [a-z]{3,6}){4,8}\."
    prompt = "It is a truth universally acknowledged, that a single man in possession of a good fortune"
    outs = small.generate([prompt] * 6, _params({"regex": regex}, n=2, seed=21, max_tokens=80),
                          use_tqdm=False)
    for out in outs:
        for c in out.outputs:
            assert c.finish_reason == "stop" and re.fullmatch(regex, c.text), c.text
    assert small.engine.core.scheduler.num_preemptions > 0


# ----- validation ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, words", [
    ({"json": {"type": "object", "properties": {"a": {"type": "strnig"}}}}, "JSON schema"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"regex": "(unclosed"}, "regular expression"),
    ({"grammar": "root ::= missing_rule"}, "EBNF grammar"),
    ({"regex": "a", "choice": ["b"]}, "exactly one"),
    ({}, "exactly one"),
    ({"choice": []}, "choice"),
])
def test_invalid_constraints_say_what_is_wrong(spec, words):
    with pytest.raises(SamplingParamsError, match=words):
        StructuredOutputsParams(**spec)


def test_sampling_params_fields_are_validated():
    with pytest.raises(SamplingParamsError, match="logit_bias"):
        SamplingParams(logit_bias={5: 101.0})
    with pytest.raises(SamplingParamsError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})
    with pytest.raises(SamplingParamsError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    p = SamplingParams(structured_outputs={"regex": "a+"})
    assert isinstance(p.structured_outputs, StructuredOutputsParams) and p.structured_outputs.kind == "regex"


def test_engine_refuses_token_ids_outside_the_vocabulary(llm):
    with pytest.raises(SamplingParamsError, match="token id 999999"):
        llm.generate("a", SamplingParams(allowed_token_ids=[1, 999999]), use_tqdm=False)


# ----- the sampler's masks -------------------------------------------------------------------------------
def test_bitmask_logit_bias_and_allowed_ids_in_the_sampler():
    V = 70
    logits = torch.randn(3, V)
    words = torch.zeros(1, 3, dtype=torch.int32)
    words[0, 1] = 1 << 4  # only token 36
    x = logits.clone()
    apply_token_bitmask(x, words, torch.tensor([1]))
    assert torch.isinf(x[1]).sum() == V - 1 and x[1, 36] == logits[1, 36]
    assert torch.equal(x[0], logits[0]) and torch.equal(x[2], logits[2])
    words = torch.full((1, 3), -1, dtype=torch.int32)  # bit 31 (the sign bit) means token 31 too
    words[0, 0] = -(1 << 31)
    x = logits[:1].clone()
    apply_token_bitmask(x, words)
    assert not torch.isinf(x[0, 31]) and torch.isinf(x[0, :31]).all() and not torch.isinf(x[0, 32:]).any()

    s = Sampler()
    rows = [SamplingRow(SamplingParams(temperature=0.0, allowed_token_ids=[3, 9]), [1], []),
            SamplingRow(SamplingParams(temperature=0.0, logit_bias={7: 100.0}), [1], []),
            SamplingRow(SamplingParams(temperature=1.0, seed=1), [1], [], token_bitmask=torch.tensor(
                [0, 1 << 2, 0], dtype=torch.int32))]
    out = s(logits, rows)
    assert out.token_ids[0] == (3 if logits[0, 3] > logits[0, 9] else 9)
    assert out.token_ids[1] == 7
    assert out.token_ids[2] == 34


def test_mask_overhead_per_step_is_small(llm):
    """Mask build (matcher fill) + apply per step, measured on the embedded model
    (reported, loosely bounded)."""
    from forwardpass.structured.backend import GrammarBackend

    backend = llm.engine.core.runner.grammars
    assert isinstance(backend, GrammarBackend)
    so = StructuredOutputsParams(json=SCHEMAS["order_with_refs"])
    B = 16
    items = [(so, None, []) for _ in range(B)]
    states, masks, bad = backend.prepare(items)
    assert not bad
    logits = torch.randn(B, backend.vocab_size)
    t0 = time.perf_counter()
    steps = 20
    for _ in range(steps):
        states, masks, bad = backend.prepare([(so, st, []) for st in states])
        x = logits.clone()
        apply_token_bitmask(x, torch.stack(masks))  # type: ignore[arg-type]
    per_step = (time.perf_counter() - t0) / steps
    print(f"mask build + apply for {B} constrained rows, vocab {backend.vocab_size}: {per_step * 1e3:.3f} "
          "ms/step")
    assert per_step < 0.05


def test_constraint_applies_after_reasoning(llm):
    """With ``reasoning_end`` (the server sets it to ``</think>``'s ids under a reasoning parser) the output
    is free until those tokens, constrained after them."""
    from forwardpass.structured.backend import GrammarBackend

    backend = llm.engine.core.runner.grammars
    assert isinstance(backend, GrammarBackend)
    tok = llm.get_tokenizer()
    end = tuple(tok.encode("</think>", add_special_tokens=False))
    so = StructuredOutputsParams(regex="[0-9]+", reasoning_end=end)
    states, masks, bad = backend.prepare([(so, None, [])])
    assert masks == [None] and not bad  # reasoning: free
    free_tokens = tok.encode("I think so", add_special_tokens=False)
    states, masks, bad = backend.prepare([(so, states[0], free_tokens + list(end)[:1])])
    assert masks == [None]  # half of the end tag: still free
    states, masks, bad = backend.prepare([(so, states[0], free_tokens + list(end))])
    assert masks[0] is not None and not bad
    allowed = [t for t in range(backend.vocab_size) if int(masks[0][t // 32]) >> (t % 32) & 1]
    assert allowed and all(tok.decode([t]).strip().isdigit() for t in allowed)
