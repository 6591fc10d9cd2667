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
    flops: float = 0.0  # attributed by engine/scheduling/cost.py (the analyzer's accounting)
    bytes: float = 0.0  # weights + KV read and written
    # speculative decoding (engine/speculative/): drafts verified and accepted this step, and the tokens each
    # verifying sequence emitted (its acceptance length: accepted + 1)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    acceptance_lengths: tuple[int, ...] = ()
    draft_token_ids: tuple[tuple[int, ...], ...] = ()  # the drafts each of those sequences verified

    @property
    def achieved_flops_per_s(self) -> float:
        return self.flops / self.duration_s if self.duration_s else 0.0

    @property
    def achieved_bytes_per_s(self) -> float:
        return self.bytes / self.duration_s if self.duration_s else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["prefix_cache_hit_rate"] = self.prefix_cache_hit_rate
        d["achieved_flops_per_s"] = self.achieved_flops_per_s
        d["achieved_bytes_per_s"] = self.achieved_bytes_per_s
        return d
