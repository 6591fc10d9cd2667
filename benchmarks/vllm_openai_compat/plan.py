"""What the harness runs of vLLM's tests and how: the files, vLLM's serve flags in our terms, the model
behind each test's model name, and the cases left out of the count with the reason for each."""

from __future__ import annotations

# vLLM's test folders (under its tests/entrypoints/) that talk to an OpenAI-compatible server.
FOLDERS = ("openai", "serve/tokenize")

# The model that answers for a Hugging Face id a test names. Tests written for SmolLM2-135M-Instruct
# (tokenizer tests) get the real SmolLM2 (same tokenizer and chat template); the rest the embedded model.
_MODELS = {"HuggingFaceTB/SmolLM2-135M-Instruct": "smollm2"}
# Test files whose requests name token ids above the embedded model's vocabulary (4,096 tokens): SmolLM2
# (49,152) answers for every model name they use, and the stand-in tokenizer is its there. Not
# completion/test_completion.py (logprob_token_ids [5000], written for opt-125m, a base model): SmolLM2
# Instruct ends a bare completion at once, which three of its other tests do not expect (docs/serving.md).
_FILE_MODELS = {"chat_completion/test_logprob_token_ids.py": "smollm2"}
DEFAULT_MODEL = "forwardpass-default"


# Their context windows: a test's larger --max-model-len is dropped, since the model cannot use it and a
# request without max_tokens would then run for thousands of tokens (a real model stops at its end-of-sequence
# token long before; the embedded one often does not).
_CONTEXT = {"forwardpass-default": 1024, "smollm2": 8192}


def model_for(hf_id: str, test_file: str = "") -> str:
    """The model that answers for ``hf_id`` in ``test_file`` (a pytest node id or path; "" for any)."""
    for name, model in _FILE_MODELS.items():
        if name in test_file:
            return model
    return _MODELS.get(hf_id, DEFAULT_MODEL)


def fit_context(args: dict[str, str | None], model: str) -> list[str]:
    """Drops ``max-model-len`` from ``args`` when it exceeds ``model``'s window; returns what was dropped."""
    asked = args.get("max-model-len")
    if asked is not None and int(asked) > _CONTEXT.get(model, 1 << 30):
        del args["max-model-len"]
        return [f"--max-model-len {asked} (the model's window is {_CONTEXT[model]})"]
    return []


# vLLM flag -> ours (same value); None: a switch of ours without a value.
_SAME = {"max-model-len", "max-num-seqs", "max-num-batched-tokens", "port", "seed", "api-key",
         "served-model-name", "speculative-config", "root-path", "chat-template", "max-logprobs"}
_SWITCHES = {"no-enable-prefix-caching": "no-prefix-caching",
             "enable-force-include-usage": "enable-force-include-usage",
             "return-tokens-as-token-ids": "return-tokens-as-token-ids",
             "enable-prompt-tokens-details": "enable-prompt-tokens-details",
             "enable-tokenizer-info-endpoint": "enable-tokenizer-info-endpoint"}
# Flags that only tune vLLM's own machinery (graphs, GPU memory, schedulers): nothing to translate.
_TUNING_SWITCHES = {"enforce-eager", "trust-remote-code", "no-async-scheduling", "enable-chunked-prefill",
                    "enable-auto-tool-choice", "enable-lora", "enable-prompt-embeds", "skip-tokenizer-init",
                    "exclude-tools-when-tool-choice-none"}
# --dtype too: the model runs at its own dtype on this CPU (what a test checks does not depend on it).
_TUNING_VALUES = {"dtype", "gpu-memory-utilization", "max-cpu-loras", "load-format", "attention-backend",
                  "tensor-parallel-size", "max-lora-rank", "limit-mm-per-prompt", "runner",
                  "chat-template-content-format", "tool-call-parser", "hf-overrides"}
_REASONING = {"qwen3", "deepseek_r1"}


def translate_args(args: list[str]) -> tuple[dict[str, str | None], list[str]]:
    """vLLM's ``serve`` flags as ours (flag name -> value, None for a switch) and the flags dropped that
    change behaviour (printed by the launcher)."""
    out: dict[str, str | None] = {}
    dropped: list[str] = []
    i = 0
    while i < len(args):
        raw = args[i]
        name, _, inline = raw.lstrip("-").partition("=")
        known_switch = name in _SWITCHES or name in _TUNING_SWITCHES
        # a flag of unknown kind takes the next argument when that is not a flag itself
        takes_value = not known_switch and i + 1 < len(args) and not args[i + 1].startswith("--")
        value = inline or (args[i + 1] if takes_value and not inline and i + 1 < len(args) else None)
        i += 1 + (1 if takes_value and not inline else 0)
        if name == "lora-modules":  # one or more NAME=PATH values follow
            while i < len(args) and not args[i].startswith("--"):
                i += 1
            dropped.append(raw)
        elif name in _SAME:
            out[name] = value
        elif name in _SWITCHES:
            out[_SWITCHES[name]] = None
        elif name == "reasoning-parser" and value in _REASONING:
            out[name] = value
        elif name in _TUNING_SWITCHES or name in _TUNING_VALUES:
            if name in {"skip-tokenizer-init", "enable-prompt-embeds", "enable-lora"}:
                dropped.append(raw)
        else:
            dropped.append(f"{raw} {value or ''}".strip())
    ours = our_serve_flags()
    dropped += [f"--{k}" + ("" if v is None else f" {v}") for k, v in out.items() if k not in ours]
    return {k: v for k, v in out.items() if k in ours}, dropped


def our_serve_flags() -> set[str]:
    """The long flags ``forwardpass serve`` takes (read from its parser, so the harness follows it)."""
    import argparse

    from forwardpass.commands import serve

    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    return {opt[2:] for action in sub._actions for opt in action.option_strings if opt.startswith("--")}


# Server tests left out of the count: (regular expression over the pytest node id, why). Three kinds only:
# what needs hardware or files this harness cannot have, vLLM-only machinery (not an OpenAI or vLLM-client
# surface), and assertions about one Hugging Face model's own outputs (token counts of its tokenizer, its
# answers, its habit of thinking or calling a tool unprompted). A feature of vLLM's API that we lack is a
# failure, not an exclusion.
_LORA = "needs a LoRA adapter from the Hugging Face Hub"
_MODEL = "asserts the named model's own output"
_LONG_CONTEXT = "needs a context window above the embedded model's 1024 tokens"
_THINKS = "needs a model that thinks (Qwen3's <think> output) or picks a tool by itself (tool_choice auto)"
EXCLUDED: list[tuple[str, str]] = [
    (r"lora|models/test_models\.py", _LORA),
    (r"test_kv_transfer_prompt_token_ids", "vLLM's disaggregated prefill (kv_transfer_params)"),
    (r"test_tensorizer_entrypoint|test_token_in_token_out",
     "vLLM's model loaders (tensorizer on a GPU; downloaded weights with --skip-tokenizer-init)"),
    (r"test_parsable_context|harmony|test_mcp_tools", "gpt-oss's Harmony format (the gpt_oss package)"),
    (r"_vlm\.py|test_extra_content_fields", "a multimodal model (images)"),
    (r"test_openai_schema", "schemathesis fuzzing of vLLM's own schema (its pytest plugin does not load with "
                            "the schemathesis installed here)"),
    (r"test_long_seed", "vLLM's int64 seed range and pydantic's error-type names; ours takes any 64-bit "
                        "seed, signed or not (docs/serving.md)"),
    (r"chat_completion/.*test_max_tokens_with_tool_choice_required", "a forced call cut short by max_tokens: "
     "vLLM (as OpenAI) answers finish_reason length with no call, ours a 400 naming max_tokens (issue 43's "
     "choice; the Responses API answers status incomplete, as vLLM)"),
    (r"test_single_chat_session\[|test_single_completion\[", _MODEL + " (its tokenizer's prompt_tokens)"),
    (r"test_more_than_one_prompt_logprobs_chat", _MODEL + " (a prompt token its top-1)"),
    (r"test_complex_message_content|responses/test_basic\.py::test_(simple_input|instructions|chat)\b|"
     r"test_two_responses_with_same_prev_id|test_response_format_json_(object|schema)|"
     r"responses/test_structured_output\.py",
     _MODEL + " (its answer; the embedded model writes Austen pastiche)"),
    (r"test_chat_completion_with_emoji_and_token_ids", _MODEL + " (Qwen's <|im_end|>)"),
    # both checked against vLLM's code: it answers as we do given the embedded model's output
    (r"test_comparison_with_prompt_logprobs_and_logprobs",
     _MODEL + " (text before its end token: the embedded model ends at once, and an end token is in "
              "token_ids but not in the text, in vLLM too)"),
    (r"test_stateful\.py::test_background_cancel",
     _MODEL + " (an answer still running after the test's 5 s of polling: the embedded model's ends, or "
              "fills its 1,024 tokens, sooner on a quiet host; a completed response cannot be cancelled, in "
              "vLLM too)"),
    (r"test_chunked_prompt|test_structured_outputs_json_chat|test_named_tool_use\b|test_previous_response_id",
     _LONG_CONTEXT),
    (r"test_function_tool_use\[(plain|watermarked)-(True-|False-auto-)|test_include_reasoning_true|"
     r"test_default_includes_reasoning|"
     r"test_reasoning_tokens_in_usage|test_reasoning_item|reasoning_tokens_e2e|"
     r"responses/test_function_call\.py::test_function_tool_use\[auto|"
     # tool_choice auto: the model must decide to call (here: the named tools, two of them, a namespaced one)
     r"test_function_calling_with_streaming_expected_arguments|"
     r"test_function_calling_with_streaming_forced_tool_choice\[auto|test_namespace_tool_separator|"
     r"test_return_token_ids\.py::test_chat_completion_with_tool_use|"
     # thinking on: the budget counts tokens after the model's own <think>; a forced call follows the
     # reasoning's </think> (the grammar starts there), which the embedded model does not write
     r"test_thinking_token_budget_limits_reasoning|responses/test_function_call\.py::(test_function_tool_use"
     r"\[required|test_function_calling_with_streaming_forced_tool_choice\[(required|tool_choice2)|"
     r"test_function_calling_with_streaming_types\[True-(required|tool_choice2))", _THINKS),
]
