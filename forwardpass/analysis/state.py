"""The per-op cost of layers that keep a state instead of a KV cache (Mamba2, Gated DeltaNet), and
the attention cost against context of every kind of token mixer at equal width.

``state_mixer_ops`` is what ``roofline.forward_ops`` adds for a model's Mamba2 and Gated DeltaNet
layers: the input projections, the short causal conv, the scan (prefill: the chunked form; decode:
one recurrent update per sequence) and the output norm and projection. Each sequence's state
(``ModelSpec.state_bytes_per_sequence``, float32) is read once and written once per forward pass: that
is the state's "KV traffic" (``kv_read_bytes`` / ``kv_write_bytes``), constant in the context.

``mixer_cost_vs_context`` compares, for one layer of hidden width ``hidden``, the decode-step FLOPs
and bytes of softmax attention (reads all L keys), sliding-window attention (at most W), linear
attention / Gated DeltaNet and Mamba2 (a fixed state, whatever L) and compressed attention (a window
plus one compressed entry per ``compress_rate`` tokens, DeepSeek-V4 style: L / m entries) as the
context grows; ``plot_mixer_cost`` draws it (log-log). Given a DeepSeek-V4 ``model``, the compressed
curve is that model's own layer mix instead (``compressed_decode_cost``: one K=V vector per position,
its window, HCA layers reading all ``L / m'`` entries, CSA layers scoring all ``L / m`` index keys and
reading only the indexer's top-k entries).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from forwardpass.analysis.ops import MATMUL, VECTOR, OpCost, elementwise, linear
from forwardpass.models.spec import ModelSpec

NORM_FLOPS = 4.0
SCAN_FLOPS = {"mamba": 6.0, "gdn": 8.0}  # per state value per token (spec.state_flops_per_token)
STATE_BYTES = 4.0  # states are kept in float32


def state_mixer_ops(shape: ModelSpec, stage: str, *, tokens: int, batch: int, wb: float,
                    ab: float) -> list[OpCost]:
    """Every op of the model's Mamba2 and Gated DeltaNet layers for ``tokens`` new tokens of ``batch``
    sequences, each op summed over the layers it occurs in."""
    H, T = shape.hidden, tokens
    ops: list[OpCost] = []
    for kind, n, sizes in (("mamba", shape.mamba_layers, shape.ssm), ("gdn", shape.gdn_layers, shape.gdn)):
        if not n or sizes is None:
            continue
        state = sizes.state_size * STATE_BYTES
        if kind == "mamba":
            assert shape.ssm is not None
            s = shape.ssm
            proj_out = s.inner + s.conv_dim + s.heads
            conv_dim, inner, values = s.conv_dim, s.inner, s.ssm_state_size
            k = s.conv_kernel
        else:
            assert shape.gdn is not None
            g = shape.gdn
            proj_out = 2 * g.k_heads * g.k_dim + 2 * g.v_heads * g.v_dim + 2 * g.v_heads
            conv_dim, inner, k = g.conv_dim, g.v_heads * g.v_dim, g.conv_kernel
            values = g.v_heads * g.k_dim * g.v_dim
        layer = [
            elementwise(stage, f"{kind}.norm", T * H, flops_per_element=NORM_FLOPS, ab=ab,
                        weight_bytes=H * wb),
            linear(stage, f"{kind}.in_proj", T, H, proj_out, wb=wb, ab=ab),
            elementwise(stage, f"{kind}.conv", T * conv_dim, flops_per_element=2.0 * k, ab=ab,
                        weight_bytes=conv_dim * k * wb),
            # the scan: state updates and reads; the state itself read and written once per sequence
            OpCost(stage, f"{kind}.scan", MATMUL if T > batch else VECTOR, SCAN_FLOPS[kind] * values * T, 0.0,
                   T * (conv_dim + inner) * ab, batch * state, batch * state),
            elementwise(stage, f"{kind}.gated_norm", T * inner, flops_per_element=NORM_FLOPS + 5, ab=ab,
                        reads=2, weight_bytes=inner * wb),
            linear(stage, f"{kind}.out_proj", T, inner, H, wb=wb, ab=ab),
        ]
        ops += [op.times(n, count=n) for op in layer]
    return ops


def compressed_decode_cost(model: ModelSpec, context: int, kv_bytes: float = 2.0) -> tuple[float, float]:
    """(FLOPs, bytes) of one decode token's attention in a DeepSeek-V4 model, averaged over its layers."""
    v4 = model.dsv4
    assert v4 is not None, f"{model.name} has no compressed attention"
    d, heads, flops, nbytes = model.head_dim, model.heads, 0.0, 0.0
    for layer, m in enumerate(v4.compress_rates):
        used = min(context, v4.window)  # window positions, one K=V vector each
        if m and v4.sparse(layer):  # every index key scored, only the top-k entries attended
            entries = context // m
            flops += 2.0 * v4.index_heads * v4.index_head_dim * entries
            nbytes += entries * v4.index_head_dim * kv_bytes
            used += min(v4.index_topk, entries)
        elif m:
            used += context // m
        flops += 4.0 * heads * d * used
        nbytes += used * d * kv_bytes
    return flops / model.layers, nbytes / model.layers


def mixer_cost_vs_context(
    hidden: int, contexts: list[int], *, heads: int | None = None, window: int = 4096,
    compress_rate: int = 128, state: int = 128, kv_bytes: float = 2.0, model: ModelSpec | None = None,
) -> dict[str, list[dict[str, float]]]:
    """Decode FLOPs and bytes of one token-mixing layer of width ``hidden`` per new token, at each
    context length: ``{kind: [{"context", "flops", "bytes"}, ...]}`` for softmax, sliding, linear,
    mamba and compressed attention. Projections are the same for all and left out: this is the part
    that depends on the context."""
    d = hidden
    heads = heads or max(1, hidden // 128)
    head_dim = d // heads
    kv_per_pos = 2 * d * kv_bytes  # K and V, no GQA: equal width everywhere
    out: dict[str, list[dict[str, float]]] = {k: [] for k in ("softmax", "sliding", "linear", "mamba",
                                                              "compressed")}
    for L in contexts:
        rows = {
            "softmax": L,
            "sliding": min(L, window),
            "compressed": min(L, window) + L / compress_rate,
        }
        for kind, positions in rows.items():
            out[kind].append({"context": L, "flops": 4.0 * d * positions, "bytes": kv_per_pos * positions})
        if model is not None and model.dsv4 is not None:
            flops, nbytes = compressed_decode_cost(model, L, kv_bytes)
            out["compressed"][-1] = {"context": L, "flops": flops, "bytes": nbytes}
        lin_state = heads * head_dim * head_dim  # one [d_k, d_v] matrix per head
        out["linear"].append({"context": L, "flops": 8.0 * lin_state, "bytes": 2 * lin_state * STATE_BYTES})
        ssm_state = 2 * d * state  # Mamba2: expand 2, a [head_dim, N] state per head
        out["mamba"].append({"context": L, "flops": 6.0 * ssm_state, "bytes": 2 * ssm_state * STATE_BYTES})
    return out


def plot_mixer_cost(path: str | Path, hidden: int = 4096, contexts: list[int] | None = None,
                    **kw: Any) -> Path:
    """Log-log plot of decode bytes and FLOPs per token against context (4k → 1M) per mixer kind."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    contexts = contexts or [4096 * 2**i for i in range(9)]  # 4k ... 1M
    data = mixer_cost_vs_context(hidden, contexts, **kw)
    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    for i, key in enumerate(("bytes", "flops")):
        ax = fig.add_subplot(1, 2, i + 1)
        for kind, rows in data.items():
            ax.loglog([r["context"] for r in rows], [r[key] for r in rows], marker="o", label=kind)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(f"{key} per decode token, one layer")
        ax.set_title(f"attention {key} vs context (hidden {hidden})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    return path
