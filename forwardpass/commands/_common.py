"""Pieces shared by the LLM commands: model resolution, sampling flags, streaming to the terminal."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="Hugging Face model directory (default: the embedded model)")
    p.add_argument("--dtype", default="auto", help="auto (float32 on CPU), float32, bfloat16, float16")
    p.add_argument("--max-model-len", type=int, default=None, help="context window (default: the model's)")


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 128) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: generation_config)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def resolve_model(model: str | None) -> str:
    """The given directory, or the embedded default model."""
    if model:
        return model
    from forwardpass.assets import default_llm_path

    return str(default_llm_path())


def sampling_params_from_args(engine, args):
    from forwardpass.sampling.params import SamplingParams

    base = engine.default_sampling_params()
    overrides = {
        "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
    }
    kwargs = {k: getattr(base, k) for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")}
    kwargs.update({k: v for k, v in overrides.items() if v is not None})
    return SamplingParams(max_tokens=args.max_tokens, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
                          **kwargs)


def stream(engine, prompt, params, request_id: str = "cli", lora_request=None) -> Iterator[str]:
    """Run one request through the engine, yielding text as it becomes final."""
    engine.add_request(request_id, prompt, params, lora_request=lora_request)
    shown = 0
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id != request_id:
                    continue
                text = out.outputs[0].text
                if len(text) > shown:
                    yield text[shown:]
                    shown = len(text)
                if out.finished:
                    return
    finally:
        engine.abort(request_id)


def write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


class Timer:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.start
