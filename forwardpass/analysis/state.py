"""The per-op cost of layers that keep a state instead of a KV cache (Mamba2, Gated DeltaNet), and
the attention cost against context of every kind of token mixer at equal width.

``state_layer_ops`` is what a state family's ``mixer_ops`` (``SSMSpec``, ``GDNSpec``) gives
``analysis/forward.py`` for its Mamba2 and Gated DeltaNet layers: the input projections, the short causal
conv, the scan (prefill: the chunked form; decode: one recurrent update per sequence) and the output norm
and projection. Each sequence's state
(``ModelSpec.state_bytes_per_sequence``, float32) is read once and written once per forward pass: that
is the state's "KV traffic" (``kv_read_bytes`` / ``kv_write_bytes``), constant in the context.

``mixer_cost_vs_context`` compares, for one layer of hidden width ``hidden``, the decode-step FLOPs
and bytes of softmax attention (reads all L keys), sliding-window attention (at most W), linear
attention / Gated DeltaNet and Mamba2 (a fixed state, whatever L) and compressed attention (a window
plus one compressed entry per ``compress_rate`` tokens, DeepSeek-V4 style: L / m entries) as the
context grows; ``plot_mixer_cost`` draws it (log-log). Given a ``model`` whose family costs its own
decode attention (DeepSeek-V4: ``models/deepseek_v4_roofline.py``), the compressed curve is that model's
own layer mix instead (``compressed_decode_cost``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from forwardpass.analysis.ops import MATMUL, VECTOR, OpCost, elementwise, linear
from forwardpass.models.family import family_of

if TYPE_CHECKING:
    from forwardpass.models.model_spec import ModelSpec

NORM_FLOPS = 4.0
SCAN_FLOPS = {"mamba": 6.0, "gdn": 8.0}  # per state value per token (spec.state_flops_per_token)
STATE_BYTES = 4.0  # states are kept in float32


def state_layer_ops(kind: str, layers: int, stage: str, *, tokens: int, batch: int, hidden: int,
                    proj_out: int, conv_dim: int, inner: int, conv_kernel: int, values: int,
                    state_values: int, wb: float, ab: float) -> list[OpCost]:
    """Every op of ``layers`` state layers of one ``kind`` (``"mamba"`` or ``"gdn"``: its scan FLOPs per
    state value) for ``tokens`` new tokens of ``batch`` sequences, each op summed over the layers: the
    family gives its sizes (``SSMSpec.mixer_ops``, ``GDNSpec.mixer_ops``). ``values``: state values each
    token updates and reads; ``state_values``: what one sequence keeps per layer (conv window and state)."""
    if not layers:
        return []
    H, T = hidden, tokens
    state = state_values * STATE_BYTES
    layer = [
        elementwise(stage, f"{kind}.norm", T * H, flops_per_element=NORM_FLOPS, ab=ab,
                    weight_bytes=H * wb),
        linear(stage, f"{kind}.in_proj", T, H, proj_out, wb=wb, ab=ab),
        elementwise(stage, f"{kind}.conv", T * conv_dim, flops_per_element=2.0 * conv_kernel, ab=ab,
                    weight_bytes=conv_dim * conv_kernel * wb),
        # the scan: state updates and reads; the state itself read and written once per sequence
        OpCost(stage, f"{kind}.scan", MATMUL if T > batch else VECTOR, SCAN_FLOPS[kind] * values * T, 0.0,
               T * (conv_dim + inner) * ab, batch * state, batch * state),
        elementwise(stage, f"{kind}.gated_norm", T * inner, flops_per_element=NORM_FLOPS + 5, ab=ab,
                    reads=2, weight_bytes=inner * wb),
        linear(stage, f"{kind}.out_proj", T, inner, H, wb=wb, ab=ab),
    ]
    return [op.times(layers, count=layers) for op in layer]


def compressed_decode_cost(model: ModelSpec, context: int, kv_bytes: float = 2.0) -> tuple[float, float]:
    """(FLOPs, bytes) of one decode token's attention in a model with compressed attention (DeepSeek-V4),
    averaged over its layers: its family's (``ModelFamily.decode_attention_cost``)."""
    cost = family_of(model).decode_attention_cost(model, context, kv_bytes)
    assert cost is not None, f"{model.name} has no compressed attention"
    return cost


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
        own = family_of(model).decode_attention_cost(model, L, kv_bytes) if model is not None else None
        if own is not None:
            flops, nbytes = own
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
