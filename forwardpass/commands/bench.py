"""``forwardpass bench serve``: the online serving benchmark (TTFT, TPOT, ITL, end-to-end latency)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (bench serve: against a running server)")
    kinds = p.add_subparsers(dest="bench_kind", metavar="KIND")
    s = kinds.add_parser("serve", help="stream requests to an OpenAI-compatible server and report latencies")
    s.add_argument("--base-url", default="http://127.0.0.1:8000")
    s.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    s.add_argument("--api-key", default=None)
    s.add_argument("--num-prompts", type=int, default=100)
    s.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s, Poisson (default: all at once)")
    s.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    s.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    s.add_argument("--output-len", type=int, default=64, help="generated tokens per request (EOS ignored)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--save-result", default=None, metavar="FILE",
                   help="write the result and per-request records as JSON")
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(func=run_serve)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def run_serve(args: argparse.Namespace) -> int:
    import asyncio
    import json
    from pathlib import Path

    from forwardpass.bench.serve import BenchConfig, format_result, run_benchmark
    from forwardpass.errors import ValidationError

    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValidationError(f"--{name.replace('_', '-')} must be >= 1", param=name)
    if args.request_rate <= 0 or (args.max_concurrency is not None and args.max_concurrency < 1):
        raise ValidationError("--request-rate must be > 0 and --max-concurrency >= 1")
    cfg = BenchConfig(base_url=args.base_url.rstrip("/"), num_prompts=args.num_prompts,
                      request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                      input_len=args.input_len, output_len=args.output_len, model=args.model,
                      api_key=args.api_key, seed=args.seed)
    import httpx

    from forwardpass.errors import ForwardpassError

    try:
        result = asyncio.run(run_benchmark(cfg, progress=not args.no_progress))
    except httpx.HTTPStatusError as exc:  # it answered, with an error: say which, not "cannot reach"
        code = exc.response.status_code
        hint = ("; pass its key with --api-key" if code == 401 else
                "; is --base-url the server's root (without /v1)?" if code == 404 else "")
        raise ForwardpassError(f"the server at {cfg.base_url} answered HTTP {code} to {exc.request.method} "
                               f"{exc.request.url.path}{hint}") from None
    except httpx.HTTPError as exc:
        raise ForwardpassError(f"cannot reach the server at {cfg.base_url}: "
                               f"{type(exc).__name__}: {exc}") from exc
    print(format_result(result))
    if args.save_result:
        Path(args.save_result).write_text(json.dumps(result, indent=2))
        print(f"saved to {args.save_result}")
    return 0 if result["failed_requests"] == 0 else 1
