"""Pieces shared by the LLM commands: model resolution, sampling flags, streaming to the terminal."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable, Iterator


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="a name from `forwardpass models` (forwardpass-default, smollm2, ...), a model "
                   "directory, a .gguf file or a Hugging Face id (e.g. Qwen/Qwen3-0.6B, found in or "
                   "downloaded to the Hugging Face cache); default: the embedded model")
    p.add_argument("--revision", default=None,
                   help="with a Hugging Face id: branch, tag or commit (default: main)")
    p.add_argument("--dtype", default="auto",
                   help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16")
    p.add_argument("--max-model-len", type=int, default=None, help="context window (default: the model's)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")


def add_quantization_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantization", default=None, choices=["int8", "int4"],
                   help="quantize the weights at load for CPU decode: int8 (Q8_0 blocks, ~4x fewer bytes per "
                   "token than float32) or int4 (Q4_0 blocks); default: none")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float16", "bfloat16"],
                   help="what the KV cache stores: auto (the "
                   "model's dtype), float16 or bfloat16 (half the memory of float32: twice the context; "
                   "values rounded once when stored)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="kernels chosen so a "
                   "request's greedy tokens and logprobs are bitwise the same whatever else shares its steps "
                   "(batch size, chunking); dense Llama-family models on CPU; prefill is slower")
    p.add_argument("--speculative-config", type=speculative_config_arg, default=None, metavar="JSON",
                   help="speculative decoding, as vLLM spells it: '{\"method\": \"ngram\", "
                   "\"num_speculative_tokens\": 4, \"prompt_lookup_min\": 2, \"prompt_lookup_max\": 4}' "
                   "(docs/speculative.md)")


def speculative_config_arg(text: str) -> dict:
    """``--speculative-config JSON`` as vLLM spells it: '{"method": "ngram", "num_speculative_tokens": 4}'."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a JSON object, e.g. '{\"method\": \"ngram\"}'")
    return value


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 128) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: generation_config)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed; without one, each request draws a random seed (as vLLM does), so "
                   "runs at temperature > 0 differ; give one to repeat a run")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def check_device(device: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N`` that exists here, or a one-line ``ConfigError``."""
    import torch

    from forwardpass.errors import ConfigError

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ConfigError(f"--device {device!r} is not a device; use cpu, cuda or cuda:N",
                          param="device") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {device}: CUDA is not available on this machine (torch "
                              f"{torch.__version__}); use --device cpu", param="device")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA "
                              "device(s)", param="device")
    elif dev.type != "cpu":
        raise ConfigError(f"--device {device!r} is not supported; use cpu, cuda or cuda:N", param="device")
    return str(dev)


def resolve_model(model: str | None, revision: str | None = None, flag: str = "--model") -> str:
    """The model directory for ``--model`` through the one registry (``forwardpass/registry.py``): a name
    from ``forwardpass models``, a directory, a ``.gguf`` file or a Hugging Face id; None: the embedded
    default; an empty value is an error naming ``flag``."""
    from forwardpass.registry import resolve_model as resolve

    return str(resolve(model, revision, flag=flag))


def read_prompt(text: str) -> str:
    """``-`` reads the prompt from standard input (``cat prompt.txt | forwardpass generate -``)."""
    return sys.stdin.read() if text == "-" else text


@contextlib.contextmanager
def progress(message: str) -> Iterator[None]:
    """A spinner with elapsed time on stderr while something slow runs (only on a terminal), then one line
    saying how long it took; a compile inside it names itself on that line (``forwardpass/progress.py``)."""
    from forwardpass.progress import status

    with status(message):
        yield


def load_engine(args: argparse.Namespace, **config_kwargs):
    """The ``LLMEngine`` for ``--model/--revision/--dtype/--max-model-len/--device``,
    with a progress spinner."""
    from forwardpass.config import EngineConfig
    from forwardpass.engine.frontend.llm_engine import LLMEngine

    device = check_device(args.device)
    model = resolve_model(args.model, getattr(args, "revision", None))
    config_kwargs.setdefault("quantization", getattr(args, "quantization", None))
    config_kwargs.setdefault("kv_cache_dtype", getattr(args, "kv_cache_dtype", "auto"))
    config_kwargs.setdefault("batch_invariant", getattr(args, "batch_invariant", False))
    config_kwargs.setdefault("speculative_config", getattr(args, "speculative_config", None))
    config = EngineConfig(dtype=args.dtype, max_model_len=args.max_model_len, device=device, **config_kwargs)
    with progress(f"loading {model if args.model else 'the embedded model'}"):
        engine = LLMEngine(model, config)
    if getattr(args, "verbose", False):
        print_plan(engine, args.model or "the embedded model")
    return engine


def add_verbose_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verbose", "-v", action="store_true",
                   help="once loaded, print the execution plan on stderr: each layer kind's weight format "
                   "and what multiplies it, the compiled kernels and their instruction sets, the KV cache's "
                   "dtype, the threads")


def print_plan(engine, name: str) -> None:
    """The execution plan as ``serve``'s banner says it (``commands/plan_text.py``), on stderr."""
    import torch

    from forwardpass.commands.plan_text import plan_lines
    from forwardpass.layers.weight_report import described_plan

    plan = described_plan(engine.core.plan, engine.core.model)
    print(f"forwardpass: {name}: {engine.spec.architecture}, computing in {plan['dtype']} on "
          f"{plan['device']}", file=sys.stderr)
    for line in plan_lines(plan, torch.get_num_threads()):
        print(line, file=sys.stderr)


def sampling_params_from_args(engine, args):
    from forwardpass.sampling.params import SamplingParams

    base = engine.default_sampling_params()
    overrides = {
        "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
    }
    kwargs = {k: getattr(base, k) for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")}
    kwargs.update({k: v for k, v in overrides.items() if v is not None})
    seed = args.seed
    if seed is None and kwargs["temperature"] > 0:  # vLLM: a random seed per request unless one is given
        import secrets

        seed = secrets.randbits(31)
    return SamplingParams(max_tokens=args.max_tokens, seed=seed, stop=args.stop, ignore_eos=args.ignore_eos,
                          **kwargs)


def stream(engine, prompt, params, request_id: str = "cli", lora_request=None,
           stop: Callable[[], bool] | None = None) -> Iterator[str]:
    """Run one request through the engine, yielding text as it becomes final; ``stop()`` true between two
    steps ends it early (the request is aborted, its KV blocks freed)."""
    engine.add_request(request_id, prompt, params, lora_request=lora_request)
    shown = 0
    try:
        while engine.has_unfinished_requests() and not (stop and stop()):
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


def check_oversubscription(engine) -> None:
    """After a request: one warning per process if decode ran far slower than predicted while other work
    held the cores (``analysis/oversubscription.py``)."""
    from forwardpass.analysis.oversubscription import watch_engine

    watch_engine(engine).observe(engine.stats)


def write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


class Timer:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.start
