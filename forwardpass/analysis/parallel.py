"""Communication of tensor / expert parallelism per engine step, and its time on an interconnect.

What the engine's parallel layers send (``forwardpass/layers/parallel_linear.py``,
``forwardpass/layers/parallel_moe.py``), for a step of ``T`` tokens on ``N`` ranks:

* one all-reduce of the ``[T, hidden]`` activations after the vocab-parallel embedding, after every
  attention block (``o_proj``) and after every MLP or MoE block (``down_proj`` / the experts' partial
  outputs — with expert parallelism too: the tokens are replicated on every rank, so the experts'
  partial sums are all-reduced rather than dispatched all-to-all);
* one gather of the sampled rows' logits (``[S, V / N]`` float32 from each rank) on rank 0.

A ring all-reduce of ``B`` bytes sends and receives ``2 · (N - 1) / N · B`` per rank, in
``2 · (N - 1)`` latency-bound hops. For comparison the all-to-all dispatch an attention-data-parallel
MoE would need (each token's hidden state to the ranks of its ``k`` experts and back) is reported too.

Interconnects (per GPU, per direction, as the vendors quote them):

* NVLink 3 (A100 SXM): 600 GB/s total → 300 GB/s each way; NVLink 4 (H100/H200 SXM): 900 → 450;
  NVLink 5 (B200): 1.8 TB/s → 900 GB/s.
* PCIe 4.0 x16: 32 GB/s each way (31.5 after encoding); PCIe 5.0 x16: 64 (63).
* InfiniBand HDR: 200 Gb/s = 25 GB/s per port; NDR: 400 Gb/s = 50 GB/s (between nodes, one NIC per GPU).
* AMD Infinity Fabric (MI300X): 7 links × 64 GB/s = 448 GB/s each way to the 7 peers of an 8-GPU node.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from forwardpass.analysis.hardware import Hardware, get_hardware
from forwardpass.errors import ConfigError
from forwardpass.models.model_spec import ModelSpec

GB = 1e9


@dataclass(frozen=True)
class Interconnect:
    name: str
    label: str
    bandwidth: float  # bytes/s per GPU per direction
    latency: float  # seconds per hop (launch + wire), the floor of a small collective
    source: str


INTERCONNECTS: dict[str, Interconnect] = {
    "nvlink3": Interconnect(
        "nvlink3", "NVLink 3 (A100 SXM)", 300 * GB, 5e-6, "NVIDIA A100 datasheet: 600 GB/s NVLink"
    ),
    "nvlink4": Interconnect(
        "nvlink4", "NVLink 4 (H100/H200 SXM)", 450 * GB, 5e-6, "NVIDIA H100 datasheet: 900 GB/s NVLink"
    ),
    "nvlink5": Interconnect(
        "nvlink5", "NVLink 5 (B200)", 900 * GB, 5e-6, "NVIDIA HGX B200 datasheet: 1.8 TB/s NVLink"
    ),
    "pcie4": Interconnect("pcie4", "PCIe 4.0 x16", 31.5 * GB, 10e-6, "PCI-SIG: 16 GT/s x16, 128b/130b"),
    "pcie5": Interconnect("pcie5", "PCIe 5.0 x16", 63 * GB, 10e-6, "PCI-SIG: 32 GT/s x16, 128b/130b"),
    "ib-hdr": Interconnect(
        "ib-hdr", "InfiniBand HDR (200 Gb/s)", 25 * GB, 20e-6, "NVIDIA ConnectX-6: 200 Gb/s"
    ),
    "ib-ndr": Interconnect(
        "ib-ndr", "InfiniBand NDR (400 Gb/s)", 50 * GB, 20e-6, "NVIDIA ConnectX-7: 400 Gb/s"
    ),
    "infinity-fabric": Interconnect(
        "infinity-fabric",
        "AMD Infinity Fabric (MI300X)",
        448 * GB,
        5e-6,
        "AMD MI300X datasheet: 896 GB/s peer-to-peer, 7 links",
    ),
}

#: the link between GPUs of one node for each accelerator of the hardware table
NODE_INTERCONNECT = {
    "a100": "nvlink3",
    "h100": "nvlink4",
    "h200": "nvlink4",
    "b200": "nvlink5",
    "l4": "pcie4",
    "l40s": "pcie4",
    "mi300x": "infinity-fabric",
}


def get_interconnect(name: str | None, hardware: str | Hardware | None = None) -> Interconnect:
    """``name`` from :data:`INTERCONNECTS`, or the node link of ``hardware`` when ``name`` is None."""
    if name is None:
        hw = get_hardware(hardware) if hardware is not None else None
        name = NODE_INTERCONNECT.get(hw.name, "pcie4") if hw is not None else "pcie4"
    if name not in INTERCONNECTS:
        raise ConfigError(
            f"unknown interconnect {name!r}; known: {', '.join(INTERCONNECTS)}", param="interconnect"
        )
    return INTERCONNECTS[name]


@dataclass(frozen=True)
class StepCommunication:
    tp: int
    expert_parallel: bool
    tokens: int
    sampled: int
    all_reduces: int  # collectives in the step
    all_reduce_payload: int  # bytes of the tensors all-reduced (what each rank holds before the sum)
    all_reduce_traffic: int  # bytes each rank sends (= receives) in a ring all-reduce
    logits_gather: int  # bytes rank 0 receives from the others
    all_to_all_alternative: int  # bytes per rank an all-to-all expert dispatch + combine would send
    interconnect: str
    time_s: float  # predicted communication time of the step (not overlapped with compute)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def step_communication(
    spec: ModelSpec,
    tp: int,
    tokens: int,
    sampled: int | None = None,
    *,
    dtype_bytes: int = 2,
    expert_parallel: bool = False,
    interconnect: str | Interconnect = "nvlink4",
) -> StepCommunication:
    """Bytes the ranks exchange in one step of ``tokens`` tokens (``sampled`` of them
    sampled: default all)."""
    if tp < 1:
        raise ConfigError(f"tp must be >= 1, got {tp}", param="tp")
    link = interconnect if isinstance(interconnect, Interconnect) else get_interconnect(interconnect)
    sampled = tokens if sampled is None else sampled
    if tp == 1:
        return StepCommunication(1, expert_parallel, tokens, sampled, 0, 0, 0, 0, 0, link.name, 0.0)
    n_reduce = 1 + 2 * spec.layers  # embedding, then attention and MLP/MoE of every layer
    payload = tokens * spec.hidden * dtype_bytes
    ring = 2 * (tp - 1) * payload // tp
    per_rank_vocab = -(-spec.vocab // tp)
    gather = (tp - 1) * sampled * per_rank_vocab * 4  # float32 logits
    moe_layers = spec.moe_layers
    a2a = (
        2 * moe_layers * tokens * spec.moe.experts_per_tok * spec.hidden * dtype_bytes * (tp - 1) // tp
        if spec.moe and moe_layers
        else 0
    )
    time_s = (
        n_reduce * (2 * (tp - 1) * link.latency + ring / link.bandwidth)
        + link.latency
        + gather / link.bandwidth
    )
    return StepCommunication(
        tp,
        expert_parallel,
        tokens,
        sampled,
        n_reduce,
        n_reduce * payload,
        n_reduce * ring,
        gather,
        a2a,
        link.name,
        time_s,
    )


def communication_rows(
    spec: ModelSpec,
    tp: int,
    prefill: int,
    batches: tuple[int, ...] | list[int],
    *,
    dtype_bytes: int = 2,
    expert_parallel: bool = False,
    interconnect: str | None = None,
    hardware: str | Hardware | None = None,
) -> list[dict[str, Any]]:
    """One row per step kind: a ``prefill``-token prefill step (one sampled row), then a decode step per
    batch size (every row sampled)."""
    link = get_interconnect(interconnect, hardware)
    steps = [("prefill", prefill, 1)] + [(f"decode x{b}", b, b) for b in batches]
    return [
        {
            "step": name,
            **step_communication(
                spec,
                tp,
                tokens,
                sampled,
                dtype_bytes=dtype_bytes,
                expert_parallel=expert_parallel,
                interconnect=link,
            ).to_dict(),
        }
        for name, tokens, sampled in steps
    ]


def render_communication(rows: list[dict[str, Any]]) -> list[str]:
    """Plain-text table lines of :func:`communication_rows`."""
    if not rows:
        return []
    link = INTERCONNECTS[rows[0]["interconnect"]]
    title = (
        f"tensor parallel: {rows[0]['tp']} ranks over {link.label} ({link.bandwidth / GB:g} GB/s per "
        f"direction, ~{link.latency * 1e6:g} us per hop)"
    )
    lines = [
        title,
        f"{'step':<14}{'tokens':>8}{'all-reduces':>13}{'MB sent/rank':>14}{'logits MB':>11}{'time ms':>10}",
    ]
    for r in rows:
        lines.append(
            f"{r['step']:<14}{r['tokens']:>8}{r['all_reduces']:>13}{r['all_reduce_traffic'] / 1e6:>14.2f}"
            f"{r['logits_gather'] / 1e6:>11.2f}{r['time_s'] * 1e3:>10.3f}"
        )
    return lines
