"""``forwardpass chat``: an interactive conversation using the model's chat template."""

from __future__ import annotations

import argparse

from forwardpass.commands._common import add_model_args, add_sampling_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="interactive chat using the model's chat template")
    add_model_args(p)
    add_sampling_args(p, max_tokens=256)
    p.add_argument("--system", default=None, help="system message")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from forwardpass.commands._common import resolve_model, sampling_params_from_args, stream, write
    from forwardpass.config import EngineConfig
    from forwardpass.engine.llm_engine import LLMEngine

    engine = LLMEngine(resolve_model(args.model), EngineConfig(dtype=args.dtype, max_model_len=args.max_model_len))
    if engine.tokenizer is None:
        print("error: this model has no tokenizer, so chat is not possible")
        return 1
    params = sampling_params_from_args(engine, args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("Type a message; an empty line or Ctrl-D quits.")
    turn = 0
    while True:
        try:
            user = input("> ")
        except EOFError:
            break
        if not user.strip():
            break
        messages.append({"role": "user", "content": user})
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        reply = ""
        for delta in stream(engine, ids, params, request_id=f"chat-{turn}"):
            reply += delta
            write(delta)
        write("\n")
        messages.append({"role": "assistant", "content": reply})
        turn += 1
    return 0
