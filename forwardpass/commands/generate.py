"""``forwardpass generate PROMPT``: stream a completion to the terminal."""

from __future__ import annotations

import argparse

from forwardpass.commands._common import add_model_args, add_sampling_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt (streams tokens)")
    p.add_argument("prompt", help="the prompt text")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--stats", action="store_true", help="print time to first token and decode speed")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import sys

    from forwardpass.commands._common import Timer, resolve_model, sampling_params_from_args, stream, write
    from forwardpass.config import EngineConfig
    from forwardpass.engine.llm_engine import LLMEngine

    timer = Timer()
    engine = LLMEngine(resolve_model(args.model), EngineConfig(dtype=args.dtype, max_model_len=args.max_model_len))
    params = sampling_params_from_args(engine, args)
    write(args.prompt)
    first = None
    for delta in stream(engine, args.prompt, params):
        if first is None:
            first = timer()
        write(delta)
    write("\n")
    if args.stats and engine.stats:
        decode = [r for r in engine.stats if r.num_decode_tokens]
        dt = sum(r.duration_s for r in decode)
        rate = len(decode) / dt if dt else 0.0
        print(f"[first text after {first or 0:.2f}s since start; decode {rate:.1f} tok/s]", file=sys.stderr)
    return 0
