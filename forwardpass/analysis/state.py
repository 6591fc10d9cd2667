"""The attention cost against context of every kind of token mixer at equal width (the per-op cost of a
state layer itself is its family's: ``models/state_ops.py``).

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

from forwardpass.models.family import family_of
from forwardpass.models.state_ops import STATE_BYTES

if TYPE_CHECKING:
    from forwardpass.models.model_spec import ModelSpec


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
