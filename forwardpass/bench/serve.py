"""Online serving benchmark: stream requests at a given rate and concurrency against an OpenAI-compatible
server and report TTFT, TPOT, ITL and end-to-end latency (like ``vllm bench serve``).

Prompts are ``input_len`` token ids drawn from the server's own tokenization of a fixed text (so every id
is valid for its vocabulary); each asks for exactly ``output_len`` tokens (``ignore_eos``).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import httpx

_TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be "
         "in want of a wife. However little known the feelings or views of such a man may be on his first "
         "entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families, "
         "that he is considered the rightful property of some one or other of their daughters. 0123456789 "
         ",.;:!?")


@dataclass
class RequestRecord:
    index: int
    success: bool = False
    error: str | None = None
    prompt_tokens: int = 0  # from the final usage chunk
    output_tokens: int = 0
    start: float = 0.0  # seconds since the benchmark began
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class BenchConfig:
    base_url: str
    num_prompts: int = 100
    request_rate: float = float("inf")
    max_concurrency: int | None = None
    input_len: int = 128
    output_len: int = 64
    model: str | None = None
    api_key: str | None = None
    seed: int = 0
    timeout_s: float = 600.0


async def _token_pool(client: httpx.AsyncClient, model: str) -> list[int] | None:
    try:
        r = await client.post("/tokenize",
                              json={"model": model, "prompt": _TEXT, "add_special_tokens": False})
        if r.status_code == 200:
            return sorted(set(r.json()["tokens"]))
    except (httpx.HTTPError, KeyError, ValueError):
        pass
    return None


async def _one(client, cfg: BenchConfig, model: str, prompt, rec: RequestRecord, t0: float) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": cfg.output_len, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    rec.start = start - t0
    last = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    rec.error = data["error"].get("message", "error")
                    return
                now = time.perf_counter()
                if data.get("choices"):  # the server sends a chunk per step that generated tokens
                    if rec.ttft is None:
                        rec.ttft = now - start
                    else:
                        rec.itl.append(now - last)
                    last = now
                if data.get("usage"):
                    rec.prompt_tokens = data["usage"]["prompt_tokens"]
                    rec.output_tokens = data["usage"]["completion_tokens"]
        rec.e2e = time.perf_counter() - start
        if rec.ttft is None:
            rec.error = "the stream carried no choices"
            return
        rec.success = True
    except (httpx.HTTPError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"


async def run_benchmark(cfg: BenchConfig, progress: bool = True) -> dict:
    from tqdm.auto import tqdm

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.max_concurrency or cfg.num_prompts,
                          max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, timeout=cfg.timeout_s,
                                 limits=limits) as client:
        model = cfg.model
        if model is None:
            model = (await client.get("/v1/models")).raise_for_status().json()["data"][0]["id"]
        rng = random.Random(cfg.seed)
        pool = await _token_pool(client, model)
        if pool:
            prompts = [[rng.choice(pool) for _ in range(cfg.input_len)] for _ in range(cfg.num_prompts)]
        else:
            words = _TEXT.split()
            prompts = [" ".join(rng.choice(words) for _ in range(cfg.input_len))
                       for _ in range(cfg.num_prompts)]
        records = [RequestRecord(i) for i in range(cfg.num_prompts)]
        sem = asyncio.Semaphore(cfg.max_concurrency or cfg.num_prompts)
        bar = tqdm(total=cfg.num_prompts, desc="requests", unit="req", disable=not progress)

        async def limited(i: int, t0: float) -> None:
            async with sem:
                await _one(client, cfg, model, prompts[i], records[i], t0)
            bar.update(1)

        t0 = time.perf_counter()
        tasks = []
        for i in range(cfg.num_prompts):
            tasks.append(asyncio.ensure_future(limited(i, t0)))
            if cfg.request_rate != float("inf") and i + 1 < cfg.num_prompts:
                await asyncio.sleep(rng.expovariate(cfg.request_rate))  # Poisson arrivals
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
    return summarize(cfg, model, records, duration)


def _stats(values: list[float], scale: float = 1000.0) -> dict:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    ordered = sorted(values)
    k = (len(ordered) - 1) * 0.99  # linear interpolation, as numpy.percentile
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    p99 = ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)
    return {"mean": statistics.fmean(values) * scale, "median": statistics.median(values) * scale,
            "p99": p99 * scale}


def summarize(cfg: BenchConfig, model: str, records: list[RequestRecord], duration: float) -> dict:
    ok = [r for r in records if r.success]
    inp, out = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    return {
        "model": model, "base_url": cfg.base_url, "num_prompts": cfg.num_prompts,
        "request_rate": cfg.request_rate, "max_concurrency": cfg.max_concurrency, "input_len": cfg.input_len,
        "output_len": cfg.output_len, "successful_requests": len(ok),
        "failed_requests": len(records) - len(ok), "duration_s": duration, "total_input_tokens": inp,
        "total_output_tokens": out, "request_throughput": len(ok) / duration if duration else 0.0,
        "output_token_throughput": out / duration if duration else 0.0,
        "total_token_throughput": (inp + out) / duration if duration else 0.0,
        "ttft_ms": _stats([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": _stats([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "e2e_ms": _stats([r.e2e for r in ok if r.e2e is not None]),
        "errors": sorted({r.error for r in records if r.error})[:10],
        "requests": [{**asdict(r), "tpot": r.tpot} for r in records],
    }


def format_result(res: dict) -> str:
    def num(v, fmt="{:.2f}"):
        return "n/a" if v is None else fmt.format(v)

    lines = ["{:=^52}".format(" Serving Benchmark Result ")]
    rows = [("Successful requests:", res["successful_requests"]),
            ("Failed requests:", res["failed_requests"]), ("Benchmark duration (s):", num(res["duration_s"])),
            ("Total input tokens:", res["total_input_tokens"]),
            ("Total generated tokens:", res["total_output_tokens"]),
            ("Request throughput (req/s):", num(res["request_throughput"])),
            ("Output token throughput (tok/s):", num(res["output_token_throughput"])),
            ("Total token throughput (tok/s):", num(res["total_token_throughput"]))]
    lines += [f"{k:<40}{v:>12}" for k, v in rows]
    for key, title in (("ttft_ms", "Time to First Token"),
                       ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2e_ms", "End-to-end Latency")):
        lines.append("{:-^52}".format(f" {title} "))
        short = key.split("_")[0].upper()
        for stat in ("mean", "median", "p99"):
            lines.append(f"{f'{stat.capitalize()} {short} (ms):':<40}{num(res[key][stat]):>12}")
    if res["errors"]:
        lines.append("{:-^52}".format(" Errors "))
        lines += [f"  {e}" for e in res["errors"]]
    lines.append("=" * 52)
    return "\n".join(lines)
