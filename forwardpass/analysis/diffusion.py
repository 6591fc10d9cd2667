"""FLOPs and bytes of a DiT denoiser step, from its shape alone.

The block is PixArt-α/DiT style: adaLN-modulated self-attention over the image patches, cross-attention
to ``text_len`` text tokens (already projected to the model width; the text encoder and VAE are not
counted), and an MLP of width ``mlp_ratio·hidden`` with GELU. Per pass:

* ``patch_embed``: ``C·p² → hidden`` for each of ``N = (h/p)·(w/p)`` latent patches;
  ``t_embed``: the timestep MLP (256 → hidden → hidden) once per sample;
* per block: ``adaLN`` (hidden → 6·hidden, per sample), two LayerNorm+modulate, ``qkv``, fused
  self-attention (``4·N²·hidden`` FLOPs), ``attn_out``, cross-attention (``cross_q``, ``cross_kv`` over
  the text tokens, ``4·N·text_len·hidden`` FLOPs, ``cross_out``), ``fc1``, GELU, ``fc2``;
* final adaLN, LayerNorm and ``C·p²`` unpatchify projection.

Classifier-free guidance doubles the passes: the conditional and unconditional inputs run as one batch
of 2× (as diffusers does), so a step's FLOPs and activation bytes double while the weights are still
read once per step. Same accounting rules as :mod:`.roofline` (activations round-trip memory between
ops, attention fused, ``time = max(flops/peak, bytes/bandwidth)`` per op, ops back to back).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from forwardpass.analysis.dtypes import DTYPE_BYTES, normalize_dtype
from forwardpass.analysis.hardware import Hardware, get_hardware
from forwardpass.errors import ConfigError
from forwardpass.op_cost import MATMUL, OpCost, StageTotals, elementwise, json_number, linear, totals

LN_FLOPS = 7.0  # LayerNorm (mean, variance, normalise) + scale/shift modulation, per element
GELU_FLOPS = 8.0  # tanh-approximate GELU, per element
SOFTMAX_FLOPS = 5.0
T_EMBED_DIM = 256


@dataclass
class DiTReport:
    hardware: Hardware
    weight_dtype: str
    act_dtype: str
    latent: tuple[int, int, int]  # h, w, channels
    patch_size: int
    hidden: int
    depth: int
    heads: int
    text_len: int
    mlp_ratio: float
    steps: int
    cfg: bool
    batch: int
    tokens: int  # image tokens per sample
    params: int
    ops: list[OpCost]  # one denoising step (all passes)
    step: StageTotals

    @property
    def passes_per_step(self) -> int:
        return 2 if self.cfg else 1

    @property
    def total_flops(self) -> float:
        return self.step.flops * self.steps

    @property
    def total_bytes(self) -> float:
        return self.step.bytes * self.steps

    @property
    def total_time_s(self) -> float:
        return self.step.time_s * self.steps

    def to_dict(self) -> dict[str, Any]:
        s = self.step
        return {
            "hardware": self.hardware.to_dict(self.act_dtype),
            "dtypes": {"weight": self.weight_dtype, "activation": self.act_dtype},
            "latent": {"height": self.latent[0], "width": self.latent[1], "channels": self.latent[2]},
            "patch_size": self.patch_size,
            "hidden": self.hidden,
            "depth": self.depth,
            "heads": self.heads,
            "text_len": self.text_len,
            "mlp_ratio": self.mlp_ratio,
            "batch": self.batch,
            "cfg": self.cfg,
            "tokens": self.tokens,
            "params": self.params,
            "passes_per_step": self.passes_per_step,
            "step": {
                "flops": s.flops,
                "bytes": s.bytes,
                "weight_bytes": s.weight_bytes,
                "intensity": json_number(s.intensity),
                "time_s": s.time_s,
                "bound": s.bound,
            },
            "steps": self.steps,
            "total": {"flops": self.total_flops, "bytes": self.total_bytes, "time_s": self.total_time_s},
            "ops": [
                {
                    "stage": o.stage,
                    "name": o.name,
                    "count": o.count,
                    "flops": o.flops,
                    "bytes": o.bytes,
                    "intensity": json_number(o.intensity),
                    "bound": o.bound,
                    "time_s": o.time_s,
                }
                for o in self.ops
            ],
        }


def dit_params(
    latent_channels: int,
    patch_size: int,
    hidden: int,
    depth: int,
    mlp_ratio: float,
    cross_attention: bool = True,
) -> int:
    """Weights of the DiT described in the module docstring (biases not counted)."""
    H, F = hidden, round(mlp_ratio * hidden)
    io = latent_channels * patch_size**2
    cross = 4 * H * H if cross_attention else 0
    block = 6 * H * H + 4 * H * H + cross + 2 * H * F  # adaLN, self-attn, cross-attn, MLP
    return io * H + T_EMBED_DIM * H + H * H + depth * block + 2 * H * H + H * io


def dit_cost(
    latent_h: int,
    latent_w: int,
    latent_channels: int = 4,
    patch_size: int = 2,
    hidden: int = 1152,
    depth: int = 28,
    heads: int = 16,
    text_len: int = 120,
    mlp_ratio: float = 4.0,
    steps: int = 20,
    cfg: bool = True,
    *,
    batch: int = 1,
    hardware: str | Hardware = "h100",
    weight_dtype: str | None = None,
    act_dtype: str | None = None,
) -> DiTReport:
    """Per-step and total cost of ``steps`` denoising steps of a DiT on ``hardware``."""
    hw = get_hardware(hardware)
    for name, v in (
        ("latent height", latent_h), ("latent width", latent_w), ("latent channels", latent_channels),
        ("patch size", patch_size), ("width", hidden), ("depth", depth), ("heads", heads), ("steps", steps),
        ("batch", batch),
    ):  # fmt: skip
        if int(v) <= 0:
            raise ConfigError(f"DiT {name} must be positive, got {v}", param=name.replace(" ", "_"))
    if text_len < 0:
        raise ConfigError(f"text length must be >= 0, got {text_len}", param="text_len")
    if latent_h % patch_size or latent_w % patch_size:
        raise ConfigError(
            f"latent {latent_h}x{latent_w} is not divisible by patch size {patch_size}", param="patch_size"
        )
    if hidden % heads:
        raise ConfigError(f"width {hidden} is not divisible by heads {heads}", param="heads")
    w = normalize_dtype(weight_dtype or hw.default_dtype, what="weight dtype")
    a = normalize_dtype(
        act_dtype or (w if w in ("fp32", "bf16", "fp16") else hw.default_dtype),
        what="activation dtype",
        allowed=("fp32", "bf16", "fp16", "fp8", "int8"),
    )
    wb, ab = DTYPE_BYTES[w], DTYPE_BYTES[a]

    H, F = hidden, round(mlp_ratio * hidden)
    N = (latent_h // patch_size) * (latent_w // patch_size)
    io = latent_channels * patch_size**2
    S = batch * (2 if cfg else 1)  # samples per step
    tok = S * N
    txt = S * text_len
    st = "denoise"

    def lin(name: str, rows: float, d_in: int, d_out: int) -> OpCost:
        return linear(st, name, rows, d_in, d_out, wb=wb, ab=ab)

    def ln(name: str) -> OpCost:
        # reads x and the per-sample shift/scale, writes the modulated x
        return elementwise(st, name, tok * H, flops_per_element=LN_FLOPS, ab=ab)

    pre = [
        lin("patch_embed", tok, io, H),
        lin("t_embed.fc1", S, T_EMBED_DIM, H),
        lin("t_embed.fc2", S, H, H),
    ]
    block = [
        lin("adaLN", S, H, 6 * H),
        ln("norm1"),
        lin("qkv", tok, H, 3 * H),
        OpCost(st, "self_attn", MATMUL, 4.0 * S * N * N * H, 0.0, 4.0 * tok * H * ab),
        elementwise(
            st, "self_softmax", S * heads * N * N, flops_per_element=SOFTMAX_FLOPS, ab=ab, reads=0, writes=0
        ),
        lin("attn_out", tok, H, H),
    ]
    if text_len:
        block += [
            lin("cross_q", tok, H, H),
            lin("cross_kv", txt, H, 2 * H),
            OpCost(st, "cross_attn", MATMUL, 4.0 * S * N * text_len * H, 0.0, (2 * tok + 2 * txt) * H * ab),
            lin("cross_out", tok, H, H),
        ]
    block += [
        ln("norm2"),
        lin("fc1", tok, H, F),
        elementwise(st, "gelu", tok * F, flops_per_element=GELU_FLOPS, ab=ab),
        lin("fc2", tok, F, H),
    ]
    post = [lin("final_adaLN", S, H, 2 * H), ln("final_norm"), lin("unpatchify", tok, H, io)]
    ops = [*pre, *(op.times(depth, count=depth) for op in block), *post]
    for op in ops:
        op.batch = S
        op.context = N
        op.evaluate(hw, a)
    return DiTReport(
        hardware=hw,
        weight_dtype=w,
        act_dtype=a,
        latent=(latent_h, latent_w, latent_channels),
        patch_size=patch_size,
        hidden=H,
        depth=depth,
        heads=heads,
        text_len=text_len,
        mlp_ratio=mlp_ratio,
        steps=steps,
        cfg=cfg,
        batch=batch,
        tokens=N,
        params=dit_params(latent_channels, patch_size, H, depth, mlp_ratio, text_len > 0),
        ops=ops,
        step=totals(ops),
    )


def parse_size(text: str) -> tuple[int, int]:
    """``"64x64"`` or ``"64"`` → (64, 64)."""
    parts = str(text).lower().replace("×", "x").split("x")
    try:
        dims = [int(p) for p in parts]
    except ValueError:
        raise ConfigError(f"latent size {text!r} must look like 64x64", param="latent") from None
    if len(dims) == 1:
        dims = dims * 2
    if len(dims) != 2 or min(dims) <= 0:
        raise ConfigError(f"latent size {text!r} must look like 64x64", param="latent")
    return dims[0], dims[1]


__all__ = ["DiTReport", "dit_cost", "dit_params", "parse_size"]
