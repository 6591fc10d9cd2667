"""Per-step records: what the engine did in each forward pass, for callers, /metrics and the dashboard."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class StepRecord:
    step: int
    start_time: float  # time.monotonic() when the step began
    duration_s: float
    num_running: int  # after the step
    num_waiting: int
    num_seqs_scheduled: int
    num_prefill_tokens: int  # prompt / recompute tokens computed this step
    num_decode_tokens: int  # one per decoding sequence
    num_sampled: int
    kv_usage: float  # fraction of KV blocks owned by sequences
    num_free_blocks: int
    prefix_cache_queries: int  # cumulative prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # cumulative tokens served from it
    num_preemptions: int  # this step
    total_preemptions: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["prefix_cache_hit_rate"] = self.prefix_cache_hit_rate
        return d
