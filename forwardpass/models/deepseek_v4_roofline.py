"""Per-op FLOPs and bytes of DeepSeek-V4's layers (compressed attention and hyper-connections): the
roofline terms of its family (``DeepseekV4Spec.layer_ops`` / ``.decode_attention_cost``).

``dsv4_layer_ops`` is what ``analysis/forward.py`` uses instead of the standard attention layer (its MoE,
embedding and LM head are counted there as for any MoE model). Per
layer kind (sliding / CSA / HCA, each op summed over the layers of that kind):

* **hyper-connections** (twice per layer): the ``hc_mult · hidden → (2 + n)·n`` map, then collapsing
  the ``n`` streams into the block input and mixing the block output back (``n`` streams read and
  written);
* **projections**: ``wq_a``, ``wq_b``, the K=V projection (written straight into the sliding pages),
  the grouped output projection (``wo_a``: ``heads·head_dim → o_groups·o_lora_rank`` block-diagonal)
  and ``wo_b``;
* **compressor**: kv and gate projections of every token (kept in the float32 state until their window
  closes: the state is read and written once per sequence and pass), the softmax pooling, one entry
  of ``entry_dim`` values written per ``m`` tokens;
* **indexer** (CSA): its query and weight projections, then a score against *every* visible index
  key (``index_head_dim`` each, all read), and top-k;
* **attention**: each query scores its window (``min(t + 1, window)`` keys) plus its visible entries
  (HCA: all ``(t + 1) // m``; CSA: at most ``index_topk``), reading the window's K=V vectors once per
  sequence and the entries it uses (HCA: all; CSA: the top-k gathered per query in decode).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from forwardpass.op_cost import MATMUL, VECTOR, OpCost, elementwise, linear

if TYPE_CHECKING:
    from forwardpass.models.deepseek_v4_spec import DeepseekV4Spec
    from forwardpass.models.model_spec import ModelSpec

NORM_FLOPS = 4.0
SOFTMAX_FLOPS = 5.0
STATE_BYTES = 4.0  # the compressor state is float32


def _window_pairs(start: int, end: int, window: int) -> int:
    """Σ over query positions ``start .. end-1`` of ``min(t + 1, window)``."""
    grow_end = min(end, max(start, window - 1))  # positions t with t + 1 < window see t + 1 keys
    grow = (grow_end * (grow_end + 1) - start * (start + 1)) // 2 if grow_end > start else 0
    return grow + (end - max(grow_end, start)) * window


def _entries_up_to(n: int, m: int) -> int:
    """Σ_{q=1..n} q // m (closed form)."""
    k, r = divmod(n, m)
    return m * k * (k - 1) // 2 + k * (r + 1)


def entry_pairs(start: int, end: int, m: int, cap: int | None = None) -> int:
    """Σ over query positions ``start .. end-1`` of its visible entries ``(t + 1) // m`` (at most ``cap``)."""
    if cap is None:
        return _entries_up_to(end, m) - _entries_up_to(start, m)
    edge = min(max(cap * m, start), end)  # from q = cap·m on, (q // m) >= cap
    below = _entries_up_to(edge, m) - _entries_up_to(start, m) if edge > start else 0
    return below + (end - edge) * cap


def dsv4_layer_ops(
    v4: DeepseekV4Spec,
    shape: ModelSpec,
    stage: str,
    *,
    batch: int,
    new_tokens: int,
    context: int,
    wb: float,
    ab: float,
    kvb: float,
) -> list[OpCost]:
    """Every non-MoE op of the model's layers for ``batch`` sequences whose last ``new_tokens`` of
    ``context`` positions are computed, summed over the layers of each kind."""
    H, nh, d, r, T, n = (
        shape.hidden,
        shape.heads,
        shape.head_dim,
        v4.q_lora_rank,
        batch * new_tokens,
        v4.hc_mult,
    )
    start = context - new_tokens
    ops: list[OpCost] = []
    for tag, layers in v4.layers_by_kind():
        m = v4.compress_rates[layers[0]]
        layer: list[OpCost] = []
        for block in ("attn", "ffn"):
            layer.append(linear(stage, f"hc_{block}.mix", T, n * H, (2 + n) * n, wb=4.0, ab=ab))
            layer.append(
                elementwise(
                    stage,
                    f"hc_{block}.collapse+expand",
                    T * n * H,
                    flops_per_element=4.0,
                    ab=ab,
                    reads=2,
                    writes=1,
                )
            )
            layer.append(
                elementwise(
                    stage, f"{block}_norm", T * H, flops_per_element=NORM_FLOPS, ab=ab, weight_bytes=H * 4.0
                )
            )
        layer += [
            linear(stage, f"{tag}.wq_a", T, H, r, wb=wb, ab=ab),
            linear(stage, f"{tag}.wq_b", T, r, nh * d, wb=wb, ab=ab),
            linear(
                stage, f"{tag}.wkv", T, H, d, wb=wb, ab=ab, out_kv_bytes=kvb
            ),  # K = V, into the window pages
        ]
        pairs = _window_pairs(start, context, v4.window)
        kv_read = min(context, v4.window - 1 + new_tokens) * d * kvb  # the live window, once per sequence
        if m:
            sparse = v4.sparse(layers[0])
            width = (2 * d if sparse else d) + (2 * v4.index_head_dim if sparse else 0)
            new_entries = context // m - start // m
            total = context // m
            layer += [
                linear(stage, f"{tag}.compressor.wkv+wgate", T, H, 2 * width, wb=wb, ab=ab),
                OpCost(
                    stage,
                    f"{tag}.compressor.pool",
                    VECTOR,
                    batch * new_entries * (2 if sparse else 1) * m * width * 6,
                    0.0,
                    0.0,
                    batch * v4.state_size(layers[0]) * STATE_BYTES,
                    batch
                    * (new_entries * v4.entry_dim(layers[0]) * kvb + v4.state_size(layers[0]) * STATE_BYTES),
                ),
            ]
            if sparse:
                di, hi = v4.index_head_dim, v4.index_heads
                scored = entry_pairs(start, context, m)
                layer += [
                    linear(stage, f"{tag}.indexer.wq_b", T, r, hi * di, wb=wb, ab=ab),
                    linear(stage, f"{tag}.indexer.weights_proj", T, H, hi, wb=wb, ab=ab),
                    OpCost(
                        stage,
                        f"{tag}.indexer.scores",
                        MATMUL,
                        batch * 2.0 * hi * di * scored,
                        0.0,
                        T * hi * di * ab,
                        batch * total * di * kvb,
                    ),
                    elementwise(
                        stage,
                        f"{tag}.indexer.top_k",
                        batch * scored,
                        flops_per_element=2.0 * hi,
                        ab=ab,
                        reads=0,
                        writes=0,
                    ),
                ]
                pairs += entry_pairs(start, context, m, v4.index_topk)
                kv_read += min(total, new_tokens * v4.index_topk) * d * kvb  # the picked entries
            else:
                pairs += entry_pairs(start, context, m)
                kv_read += total * d * kvb
        layer += [
            OpCost(
                stage,
                f"{tag}.attn_scores",
                MATMUL,
                batch * 2.0 * nh * d * pairs,
                0.0,
                T * nh * d * ab,
                batch * kv_read,
            ),
            elementwise(
                stage,
                f"{tag}.softmax",
                batch * nh * pairs,
                flops_per_element=SOFTMAX_FLOPS,
                ab=ab,
                reads=0,
                writes=0,
            ),
            OpCost(stage, f"{tag}.attn_values", MATMUL, batch * 2.0 * nh * d * pairs, 0.0, T * nh * d * ab),
            linear(
                stage, f"{tag}.wo_a (grouped)", T, nh * d // v4.o_groups, v4.o_lora_rank, wb=wb, ab=ab
            ).times(v4.o_groups, count=1),
            linear(stage, f"{tag}.wo_b", T, v4.o_groups * v4.o_lora_rank, H, wb=wb, ab=ab),
        ]
        ops += [op.times(len(layers), count=len(layers)) for op in layer]
    head = [
        linear(stage, "hc_head.mix", T, n * H, n, wb=4.0, ab=ab),
        elementwise(stage, "hc_head.collapse", T * n * H, flops_per_element=2.0, ab=ab),
    ]
    return ops + head


def dsv4_decode_cost(v4: DeepseekV4Spec, model: ModelSpec, context: int,
                     kv_bytes: float) -> tuple[float, float]:
    """(FLOPs, bytes) of one decode token's attention, averaged over the layers: one K=V vector per
    window position, HCA layers reading all ``L / m'`` entries, CSA layers scoring all ``L / m`` index keys
    and reading only the indexer's top-k entries."""
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
