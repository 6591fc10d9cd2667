"""``forwardpass generate PROMPT``: stream a completion to the terminal."""

from __future__ import annotations

import argparse

from forwardpass.commands._common import (
    add_model_args,
    add_quantization_arg,
    add_sampling_args,
    add_verbose_arg,
)


def register(sub: argparse._SubParsersAction) -> None:
    from forwardpass.lora.cli import add_lora_args

    p = sub.add_parser("generate", help="generate text from a prompt (streams tokens)")
    p.add_argument("prompt", help="the prompt text; - reads it from standard input")
    add_model_args(p)
    add_verbose_arg(p)
    add_quantization_arg(p)
    add_sampling_args(p)
    p.add_argument("--stats", action="store_true", help="print time to first token and decode speed")
    add_lora_args(p)  # --lora NAME=PATH (repeatable): with several, the prompt runs once per adapter
    p.add_argument("--show-routing", action="store_true",
                   help="MoE models: print how many tokens each expert received per layer")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import sys

    from forwardpass.commands._common import (
        Timer,
        check_oversubscription,
        load_engine,
        read_prompt,
        sampling_params_from_args,
        stream,
        write,
    )
    from forwardpass.lora.cli import lora_engine_kwargs, parse_lora_specs

    timer = Timer()
    args.prompt = read_prompt(args.prompt)
    loras = parse_lora_specs(args.lora)
    engine = load_engine(args, **lora_engine_kwargs(loras, args.max_lora_rank))
    params = sampling_params_from_args(engine, args)
    first = None
    runs = list(loras.values()) or [None]
    for i, lora in enumerate(runs):
        if len(runs) > 1:
            write(f"{'' if i == 0 else chr(10)}[{lora.lora_name}] ")
        write(args.prompt)
        for delta in stream(engine, args.prompt, params, request_id=f"cli-{i}", lora_request=lora):
            if first is None:
                first = timer()
            write(delta)
        write("\n")
    check_oversubscription(engine)  # once per process: decode far slower than predicted, under load
    if args.stats and engine.stats:
        decode = [r for r in engine.stats if r.num_decode_tokens]
        dt = sum(r.duration_s for r in decode)
        rate = len(decode) / dt if dt else 0.0
        print(f"[first text after {first or 0:.2f}s since start; decode {rate:.1f} tok/s]", file=sys.stderr)
    if args.show_routing:
        if engine.routing_stats is None:
            print(f"[routing: {engine.spec.architecture or 'this model'} has no MoE layers]", file=sys.stderr)
        else:
            print(engine.routing_stats.summary(), file=sys.stderr)
    return 0
