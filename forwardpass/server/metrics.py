"""Prometheus metrics, one registry per app, fed by the engine's step records and request lifecycles.

Gauges come from the latest step record / idle snapshot; token counters and latency histograms from
each request when it ends (``AsyncLLMEngine.finish_listeners``), so that after a run
``prompt_tokens_total`` and ``generation_tokens_total`` equal the ``usage`` the clients received.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

if TYPE_CHECKING:
    from forwardpass.engine.frontend.async_engine import AsyncLLMEngine, RequestTiming
    from forwardpass.engine.frontend.outputs import RequestOutput
    from forwardpass.engine.scheduling.stats import StepRecord

disable_created_metrics()  # no *_created series next to every counter and histogram

P = "forwardpass:"
_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
            80.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_ITL = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


class ServerMetrics:
    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.engine = engine
        r = self.registry = CollectorRegistry()
        lbl = {"model_name": model_name}
        self.labels = lbl

        def g(name: str, doc: str) -> Gauge:
            return Gauge(P + name, doc, list(lbl), registry=r).labels(**lbl)

        self.running = g("num_requests_running", "sequences in the running batch")
        self.waiting = g("num_requests_waiting", "sequences waiting to be scheduled")
        self.kv_usage = g("kv_cache_usage_perc", "fraction of KV-cache blocks in use (0..1)")
        self.free_blocks = g("kv_cache_free_blocks", "free KV-cache blocks")
        self.prompt_tokens = Counter(P + "prompt_tokens", "prompt tokens of admitted requests", list(lbl),
                                     registry=r).labels(**lbl)
        self.generation_tokens = Counter(P + "generation_tokens", "generated tokens", list(lbl),
                                         registry=r).labels(**lbl)
        self.preemptions = Counter(P + "num_preemptions", "sequences preempted (recomputed later)", list(lbl),
                                   registry=r).labels(**lbl)
        self.success = Counter(P + "request_success", "requests that finished", [*lbl, "finished_reason"],
                               registry=r)
        self.ended = Counter(P + "request_ended", "admitted requests that ended, by how", [*lbl, "status"],
                             registry=r)
        self.restarts = Counter(P + "engine_restarts", "times a dead engine was replaced by a fresh one "
                                "(--engine-restarts)", list(lbl), registry=r).labels(**lbl)
        self._restarts_seen = 0

        def h(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(P + name, doc, list(lbl), buckets=buckets, registry=r).labels(**lbl)

        self.ttft = h("time_to_first_token_seconds", "arrival to first token", _LATENCY)
        self.itl = h("inter_token_latency_seconds", "time between two outputs of a request", _ITL)
        self.e2e = h("e2e_request_latency_seconds", "arrival to last token", _LATENCY)
        self.queue = h("request_queue_time_seconds", "arrival to first scheduled", _LATENCY)
        # Roofline of each step: achieved rates from the step records' FLOPs and bytes
        # (engine/scheduling/cost.py), utilization against the device's peaks when known (see
        # server/dashboard/state.py).
        self.flops_per_s = g("achieved_flops_per_second", "FLOP/s achieved by the last step")
        self.bytes_per_s = g("achieved_bytes_per_second", "bytes/s moved by the last step")
        self.mfu = g("model_flops_utilization", "last step's FLOP/s over the device's matmul peak (0..1)")
        self.mbu = g("model_bandwidth_utilization", "last step's bytes/s over the device's bandwidth (0..1)")
        self.flops_total = Counter(P + "step_flops", "FLOPs of all steps", list(lbl),
                                   registry=r).labels(**lbl)
        self.bytes_total = Counter(P + "step_bytes", "bytes moved by all steps", list(lbl),
                                   registry=r).labels(**lbl)
        # vLLM's series, under its own names too (dashboards built for vLLM read these), and ours
        self.vllm: dict[str, list[Histogram]] = {}

        def both(name: str, doc: str, buckets: Sequence[float]) -> None:
            self.vllm[name] = [Histogram(prefix + name, doc, list(lbl), buckets=buckets,
                                         registry=r).labels(**lbl) for prefix in (P, "vllm:")]

        both("time_per_output_token_seconds", "TPOT: (last token - first token) / (tokens - 1)", _ITL)
        both("request_prompt_tokens", "prompt tokens per request", _TOKENS)
        both("request_generation_tokens", "generated tokens per request", _TOKENS)
        both("request_prefill_time_seconds", "first scheduled to first token", _LATENCY)
        both("request_decode_time_seconds", "first token to last token", _LATENCY)
        both("request_inference_time_seconds", "first scheduled to last token", _LATENCY)
        self.prefix_queries = [Counter(prefix + "prefix_cache_queries",
                                       "prompt tokens looked up in the prefix cache", list(lbl),
                                       registry=r).labels(**lbl) for prefix in (P, "vllm:")]
        self.prefix_hits = [Counter(prefix + "prefix_cache_hits", "prompt tokens found in the prefix cache",
                                    list(lbl), registry=r).labels(**lbl) for prefix in (P, "vllm:")]
        self._prefix_seen = (0, 0)
        # speculative decoding (engine/speculative/), under vLLM's names too
        self.spec_drafts = [Counter(prefix + "spec_decode_num_draft_tokens", "draft tokens verified",
                                    list(lbl), registry=r).labels(**lbl) for prefix in (P, "vllm:")]
        self.spec_accepted = [Counter(prefix + "spec_decode_num_accepted_tokens", "draft tokens accepted",
                                      list(lbl), registry=r).labels(**lbl) for prefix in (P, "vllm:")]
        self.spec_length = h("spec_decode_acceptance_length", "tokens one verify step emitted for a sequence "
                             "(accepted drafts + 1)", tuple(range(1, 17)))
        from forwardpass.server.dashboard.state import engine_peaks

        self.peaks = engine_peaks(engine)
        engine.stat_listeners.append(self.on_step)
        engine.finish_listeners.append(self.on_finish)

    def on_step(self, record: StepRecord) -> None:
        self.flops_per_s.set(record.achieved_flops_per_s)
        self.bytes_per_s.set(record.achieved_bytes_per_s)
        self.flops_total.inc(record.flops)
        self.bytes_total.inc(record.bytes)
        if self.peaks is not None:
            self.mfu.set(record.achieved_flops_per_s / self.peaks.flops)
            self.mbu.set(record.achieved_bytes_per_s / self.peaks.bandwidth)
        if record.num_preemptions:
            self.preemptions.inc(record.num_preemptions)
        q, hits = record.prefix_cache_queries, record.prefix_cache_hits  # cumulative in the records
        dq, dh = q - self._prefix_seen[0], hits - self._prefix_seen[1]
        if dq >= 0 and dh >= 0:
            for c in self.prefix_queries:
                c.inc(dq)
            for c in self.prefix_hits:
                c.inc(dh)
        self._prefix_seen = (q, hits)
        for c in self.spec_drafts:
            c.inc(record.num_draft_tokens)
        for c in self.spec_accepted:
            c.inc(record.num_accepted_tokens)
        for length in record.acceptance_lengths:
            self.spec_length.observe(length)

    def on_finish(self, out: RequestOutput, timing: RequestTiming) -> None:
        self.ended.labels(**self.labels, status=timing.status).inc()
        if out.prompt_token_ids:
            self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(sum(len(c.token_ids) for c in out.outputs))
        if timing.status == "finished":
            reason = out.outputs[0].finish_reason if out.outputs else None
            self.success.labels(**self.labels, finished_reason=reason or "unknown").inc()
        if timing.first_token is not None:
            self.ttft.observe(timing.first_token - timing.arrival)
            self.e2e.observe((timing.last_token or timing.first_token) - timing.arrival)
        for gap in timing.itl:
            self.itl.observe(gap)
        m = out.metrics
        if m is not None and m.first_scheduled_time is not None:
            self.queue.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        num_gen = sum(len(c.token_ids) for c in out.outputs)
        self._observe("request_prompt_tokens", len(out.prompt_token_ids or ()))
        self._observe("request_generation_tokens", num_gen)
        first, last = timing.first_token, timing.last_token or timing.first_token
        if first is not None and last is not None:
            if num_gen > 1:
                self._observe("time_per_output_token_seconds", (last - first) / (num_gen - 1))
            self._observe("request_decode_time_seconds", last - first)
            if m is not None and m.first_scheduled_time is not None:
                # the engine's queue time (its own clock) placed on the front end's clock
                sched = timing.arrival + max(0.0, m.first_scheduled_time - m.arrival_time)
                self._observe("request_prefill_time_seconds", max(0.0, first - sched))
                self._observe("request_inference_time_seconds", max(0.0, last - sched))

    def _observe(self, name: str, value: float) -> None:
        for hist in self.vllm[name]:
            hist.observe(value)

    def render(self) -> bytes:
        s = self.engine.snapshot
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.kv_usage.set(s.kv_usage)
        self.free_blocks.set(s.num_free_blocks)
        restarts = self.engine.num_restarts  # counted by the engine's supervisor; the counter follows it
        self.restarts.inc(max(0, restarts - self._restarts_seen))
        self._restarts_seen = restarts
        return generate_latest(self.registry)
