"""The per-op cost of layers that keep a state instead of a KV cache (Mamba2, Gated DeltaNet).

``state_layer_ops`` is what a state family's ``mixer_ops`` (``SSMSpec``, ``GDNSpec``, or one registered from
outside the package) gives ``analysis/forward.py`` for its Mamba2 and Gated DeltaNet layers: the input
projections, the short causal conv, the scan (prefill: the chunked form; decode: one recurrent update per
sequence) and the output norm and projection. Each sequence's state (``ModelSpec.state_bytes_per_sequence``,
float32) is read once and written once per forward pass: that is the state's "KV traffic"
(``kv_read_bytes`` / ``kv_write_bytes``), constant in the context.
"""

from __future__ import annotations

from forwardpass.op_cost import MATMUL, VECTOR, OpCost, elementwise, linear

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
