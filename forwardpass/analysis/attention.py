"""Memory traffic of one attention call: naive (S and P materialised) against fused (FlashAttention-style).

For ``n_q`` queries over ``n_k`` keys, head dim ``d``, ``heads`` query heads sharing ``kv_heads`` KV heads,
elements of ``b`` bytes:

* FLOPs (both kernels): ``QKᵀ`` and ``PV`` are ``2·n_q·n_k·d`` each per head; softmax ``5·n_q·n_k`` per head
  (max, subtract, exp, sum, divide) — reported separately as ``softmax_flops`` and included in ``flops``.
* **naive**: reads Q, K, V (K and V once per *query* head, as ``repeat_kv`` does), writes S (``n_q × n_k``),
  softmax reads S and writes P, ``PV`` reads P, writes O. Traffic ``b·(4·n_q·n_k + 2·n_q·d + 2·n_k·d)``
  per head, so for a square ``N`` the matmul intensity is ``N·d / (2·(N + d))`` — about 62 FLOP/byte at
  N = 4096, d = 128 in fp16, far below any GPU's ridge.
* **fused**: Q, K, V read once (K and V once per *KV* head), O written once; S and P live in on-chip
  SRAM. Traffic ``b·(2·n_q·d·heads + 2·n_k·d·kv_heads)``; for a square ``N`` the intensity is ``N / b``
  (N/2 in fp16) — compute-bound for long sequences.
* **decode** is the fused kernel with ``n_q = 1``: each K/V element read is used by the ``heads /
  kv_heads`` query heads of its group, for an intensity of ≈ ``2·(heads/kv_heads) / b`` — about 1 per
  query head sharing a KV head in fp16: memory-bound at any batch.
* ``causal=True`` halves the scored pairs for the fused kernel (masked tiles are skipped); the naive
  kernel still computes and materialises the full matrix.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from forwardpass.analysis.dtypes import DTYPE_BYTES, normalize_dtype
from forwardpass.analysis.hardware import Hardware, get_hardware
from forwardpass.errors import ConfigError
from forwardpass.op_cost import json_number

SOFTMAX_FLOPS = 5.0


@dataclass
class AttentionCost:
    impl: str  # "naive" | "fused" | "decode"
    n_q: int
    n_k: int
    d: int
    heads: int
    kv_heads: int
    dtype: str
    matmul_flops: float
    softmax_flops: float
    qkv_read_bytes: float
    o_write_bytes: float
    s_bytes: float  # size of one materialised S (= size of P); 0 for fused kernels
    sp_traffic_bytes: float  # S written + S read + P written + P read
    time_s: float = 0.0
    bound: str = ""

    @property
    def flops(self) -> float:
        return self.matmul_flops + self.softmax_flops

    @property
    def bytes(self) -> float:
        return self.qkv_read_bytes + self.o_write_bytes + self.sp_traffic_bytes

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes

    @property
    def matmul_intensity(self) -> float:
        return self.matmul_flops / self.bytes

    def evaluate(self, hw: Hardware) -> AttentionCost:
        """Roofline time: matmuls at the matrix peak, softmax at the vector rate, bytes at bandwidth."""
        compute = self.matmul_flops / hw.peak(self.dtype) + self.softmax_flops / hw.vector_flops
        memory = self.bytes / hw.bandwidth
        self.time_s = max(compute, memory)
        self.bound = "compute" if compute >= memory else "memory"
        return self

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            flops=self.flops,
            bytes=self.bytes,
            intensity=json_number(self.intensity),
            matmul_intensity=json_number(self.matmul_intensity),
        )
        return d


def attention_cost(
    n_q: int,
    n_k: int | None = None,
    d: int = 128,
    *,
    heads: int = 1,
    kv_heads: int | None = None,
    dtype: str = "fp16",
    impl: str = "fused",
    causal: bool = False,
) -> AttentionCost:
    """FLOPs and bytes of one attention call (one sequence); ``n_k`` defaults to ``n_q``."""
    n_k = n_q if n_k is None else n_k
    kv_heads = heads if kv_heads is None else kv_heads
    for name, v in (("n", n_q), ("n_k", n_k), ("d", d), ("heads", heads), ("kv_heads", kv_heads)):
        if int(v) <= 0:
            raise ConfigError(f"attention {name} must be positive, got {v}", param=name)
    if heads % kv_heads:
        raise ConfigError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})", param="kv_heads")
    if impl not in ("naive", "fused"):
        raise ConfigError(f"unknown attention kernel {impl!r}; choose naive or fused", param="impl")
    dtype = normalize_dtype(dtype, what="attention dtype", allowed=("fp32", "bf16", "fp16", "fp8"))
    b = DTYPE_BYTES[dtype]

    if impl == "naive" or not causal:
        pairs = n_q * n_k
    else:  # queries are the last n_q of n_k positions
        pairs = _causal_pairs(n_q, n_k)
    matmul = 2 * 2.0 * pairs * d * heads
    softmax = SOFTMAX_FLOPS * pairs * heads
    if impl == "naive":
        qkv = b * d * (n_q * heads + 2 * n_k * heads)
        s = b * n_q * n_k
        sp = 4 * s * heads
    else:
        qkv = b * d * (n_q * heads + 2 * n_k * kv_heads)
        s = 0.0
        sp = 0.0
    o = b * d * n_q * heads
    name = "decode" if (impl == "fused" and n_q == 1) else impl
    return AttentionCost(name, n_q, n_k, d, heads, kv_heads, dtype, matmul, softmax, qkv, o, s, sp)


def _causal_pairs(n_q: int, n_k: int) -> float:
    """Pairs when the ``n_q`` queries are the last of ``n_k`` positions:
    sum of (n_k - n_q + i), i = 1..n_q."""
    n_q = min(n_q, n_k)
    return n_q * (n_k - n_q) + n_q * (n_q + 1) / 2


def compare_kernels(
    n: int,
    d: int = 128,
    *,
    heads: int = 1,
    kv_heads: int | None = None,
    dtype: str = "fp16",
    context: int | None = None,
    causal: bool = False,
    hardware: str | Hardware | None = "h100",
) -> list[AttentionCost]:
    """Naive and fused attention over ``n`` positions, and a decode step (one query over ``context``,
    default ``n``) — evaluated against ``hardware`` when given."""
    rows = [
        attention_cost(n, n, d, heads=heads, kv_heads=kv_heads, dtype=dtype, impl="naive", causal=causal),
        attention_cost(n, n, d, heads=heads, kv_heads=kv_heads, dtype=dtype, impl="fused", causal=causal),
        attention_cost(1, context or n, d, heads=heads, kv_heads=kv_heads, dtype=dtype, impl="fused"),
    ]
    if hardware is not None:
        hw = get_hardware(hardware)
        for r in rows:
            r.evaluate(hw)
    return rows


def formula_naive_intensity(n: int, d: int) -> float:
    """``N·d / (2·(N + d))``: the naive kernel's matmul FLOPs per byte in 2-byte dtypes."""
    return n * d / (2 * (n + d))


__all__ = ["AttentionCost", "attention_cost", "compare_kernels", "formula_naive_intensity"]
