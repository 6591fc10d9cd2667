"""Property-based test: random allocate / append / share / free / evict sequences keep the
block pool consistent."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from forwardpass.engine.scheduling.kv_cache import KVCacheManager
from forwardpass.engine.scheduling.kv_cache_spec import FullAttentionSpec, KVCacheGroup
from forwardpass.engine.scheduling.sequence import Sequence
from forwardpass.sampling.params import SamplingParams

BLOCK = 4
PARAMS = SamplingParams(max_tokens=8)

# A small alphabet of prompts that share prefixes, so sharing and eviction really happen.
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5]]

ops = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.integers(0, len(PREFIXES) - 1), st.integers(0, 9)),
        st.tuples(st.just("append"), st.integers(0, 50), st.integers(1, 6)),
        st.tuples(st.just("free"), st.integers(0, 50), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, num_blocks=st.integers(4, 16))
def test_block_pool_invariants(ops, num_blocks):
    kv = KVCacheManager([KVCacheGroup(FullAttentionSpec(BLOCK), (0,), num_blocks)],
                        enable_prefix_caching=True)
    live: list[Sequence] = []
    for op, a, b in ops:
        if op == "admit":
            seq = Sequence("r", PREFIXES[a] + [10 + b] * (b % 3), PARAMS)
            cached = kv.find_cached_prefix(seq)
            assert cached.num_tokens < seq.num_tokens  # at least one token is always left to compute
            num_new = seq.num_tokens - cached.num_tokens
            if kv.allocate_slots(seq, num_new, cached) is not None:
                seq.num_computed_tokens = seq.num_tokens
                live.append(seq)
        elif op == "append" and live:
            seq = live[a % len(live)]
            for _ in range(b):  # decode steps: one token computed per step
                seq.append_token(20 + a)
                if kv.allocate_slots(seq, 1) is None:
                    seq.token_ids.pop()
                    seq.output_token_ids.pop()
                    break
                seq.num_computed_tokens += 1
        elif op == "free" and live:
            kv.free(live.pop(a % len(live)))
        kv.check_invariants(live)
        # every live sequence's table covers exactly its computed tokens
        for seq in live:
            assert len(kv.block_table(seq)) == kv.blocks_needed(seq.num_computed_tokens)
        # shared blocks hold identical token content for every owner
        contents: dict[int, tuple] = {}
        for seq in live:
            for i, blk in enumerate(kv.block_table(seq)[: seq.num_computed_tokens // BLOCK]):
                tokens = tuple(seq.token_ids[i * BLOCK : (i + 1) * BLOCK])
                assert contents.setdefault(blk, tokens) == tokens, ("two sequences share a block with "
                                                                    "different tokens")
    for seq in live:
        kv.free(seq)
    kv.check_invariants([])
    assert kv.num_free_blocks == num_blocks
