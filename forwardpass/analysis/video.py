"""FLOPs and bytes of a video DiT step, and what they say: compute-bound, attention-dominated as clips grow,
and why video runs at batch 1.

The video DiT (``forwardpass.diffusion.video.dit``) is the image DiT over ``T·S`` tokens: ``T = F/pt``
temporal positions × ``S = (h/p)·(w/p)`` patches per latent frame. Per pass and block:

* ``attention="full"``: one self-attention over all ``T·S`` tokens: ``4·(T·S)²·hidden`` FLOPs;
* ``attention="factorized"``: spatial attention within each frame, ``4·T·S²·hidden``, then a temporal
  attention across frames at each position, ``4·S·T²·hidden``, with its own qkv / output projections.

Everything else (adaLN, qkv, cross-attention to ``text_len`` tokens, MLP) is linear in tokens, so the
attention share of the FLOPs grows with the number of frames in full attention. Same accounting as
:mod:`.diffusion` (activations round-trip memory between ops, attention fused, ``time = max(flops/peak,
bytes/bandwidth)`` per op, ops back to back). CFG doubles the samples per step.

Why batch 1: a step's arithmetic intensity at batch 1 is already far above the device's ridge point (the
weights are read once for thousands of tokens), so the step is compute-bound and a batch of ``b`` clips
takes ``b×`` as long: throughput stays flat while every clip waits ``b×`` longer — unlike LLM decode,
where batching is nearly free until the ridge. Activations (and, with unfused attention, the ``(T·S)²``
score matrix) grow with ``b`` too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from forwardpass.analysis.diffusion import GELU_FLOPS, LN_FLOPS, SOFTMAX_FLOPS, T_EMBED_DIM
from forwardpass.analysis.dtypes import DTYPE_BYTES, normalize_dtype
from forwardpass.analysis.hardware import Hardware, get_hardware
from forwardpass.errors import ConfigError
from forwardpass.op_cost import MATMUL, OpCost, StageTotals, elementwise, json_number, linear, totals

ATTENTION_OPS = ("self_attn", "self_softmax", "space_attn", "space_softmax", "time_attn", "time_softmax",
                 "cross_attn")  # fmt: skip


@dataclass
class VideoDiTReport:
    hardware: Hardware
    act_dtype: str
    weight_dtype: str
    frames: int
    latent: tuple[int, int, int]
    patch: tuple[int, int]  # (temporal, spatial)
    attention: str
    hidden: int
    depth: int
    heads: int
    text_len: int
    steps: int
    cfg: bool
    batch: int
    tokens: int  # per clip
    ops: list[OpCost]
    step: StageTotals

    @property
    def attention_share(self) -> float:
        """Fraction of a step's FLOPs spent in attention (self / space / time and cross)."""
        attn = sum(o.flops for o in self.ops if o.name in ATTENTION_OPS)
        return attn / self.step.flops

    @property
    def total_time_s(self) -> float:
        return self.step.time_s * self.steps

    def to_dict(self) -> dict[str, Any]:
        s = self.step
        return {
            "hardware": self.hardware.to_dict(self.act_dtype), "frames": self.frames,
            "latent": {"height": self.latent[0], "width": self.latent[1], "channels": self.latent[2]},
            "patch": {"t": self.patch[0], "spatial": self.patch[1]}, "attention": self.attention,
            "hidden": self.hidden, "depth": self.depth, "heads": self.heads, "text_len": self.text_len,
            "steps": self.steps, "cfg": self.cfg, "batch": self.batch, "tokens_per_clip": self.tokens,
            "attention_share": self.attention_share,
            "step": {"flops": s.flops, "bytes": s.bytes, "intensity": json_number(s.intensity),
                     "ridge": self.hardware.ridge(self.act_dtype), "time_s": s.time_s, "bound": s.bound},
            "total_time_s": self.total_time_s,
            "ops": [o.to_dict() for o in self.ops],
        }  # fmt: skip


def video_dit_cost(
    frames: int,
    latent_h: int,
    latent_w: int,
    channels: int = 4,
    patch: int = 2,
    patch_t: int = 1,
    hidden: int = 1152,
    depth: int = 28,
    heads: int = 16,
    text_len: int = 120,
    mlp_ratio: float = 4.0,
    steps: int = 30,
    cfg: bool = True,
    attention: str = "full",
    *,
    batch: int = 1,
    hardware: str | Hardware = "h100",
    weight_dtype: str | None = None,
    act_dtype: str | None = None,
) -> VideoDiTReport:
    """One denoising step (all CFG passes) of a video DiT on ``hardware``; see the module docstring."""
    hw = get_hardware(hardware)
    for name, v in (("frames", frames), ("latent height", latent_h), ("latent width", latent_w),
                    ("channels", channels), ("patch", patch), ("patch_t", patch_t), ("width", hidden),
                    ("depth", depth), ("heads", heads), ("steps", steps), ("batch", batch)):  # fmt: skip
        if int(v) <= 0:
            raise ConfigError(f"video DiT {name} must be positive, got {v}", param=name.replace(" ", "_"))
    if attention not in ("full", "factorized"):
        raise ConfigError(f"attention must be full or factorized, got {attention!r}", param="attention")
    if frames % patch_t or latent_h % patch or latent_w % patch:
        raise ConfigError(f"{frames}×{latent_h}×{latent_w} latents do not divide into "
                          f"{patch_t}×{patch}×{patch} patches", param="patch")  # fmt: skip
    if hidden % heads:
        raise ConfigError(f"width {hidden} is not divisible by heads {heads}", param="heads")
    w = normalize_dtype(weight_dtype or hw.default_dtype, what="weight dtype")
    a = normalize_dtype(act_dtype or (w if w in ("fp32", "bf16", "fp16") else hw.default_dtype),
                        what="activation dtype", allowed=("fp32", "bf16", "fp16", "fp8", "int8"))  # fmt: skip
    wb, ab = DTYPE_BYTES[w], DTYPE_BYTES[a]
    H, Fm = hidden, round(mlp_ratio * hidden)
    T, S = frames // patch_t, (latent_h // patch) * (latent_w // patch)
    N = T * S
    io = channels * patch_t * patch * patch
    B = batch * (2 if cfg else 1)  # samples per step
    tok, txt, st = B * N, B * text_len, "denoise"

    def lin(name: str, rows: float, d_in: int, d_out: int) -> OpCost:
        return linear(st, name, rows, d_in, d_out, wb=wb, ab=ab)

    def ln(name: str) -> OpCost:
        return elementwise(st, name, tok * H, flops_per_element=LN_FLOPS, ab=ab)

    def attn(name: str, groups: int, n: int) -> list[OpCost]:  # fused: q, k, v in, output out
        return [OpCost(st, f"{name}_attn", MATMUL, 4.0 * groups * n * n * H, 0.0, 4.0 * tok * H * ab),
                elementwise(st, f"{name}_softmax", groups * heads * n * n, flops_per_element=SOFTMAX_FLOPS,
                            ab=ab,
                            reads=0, writes=0)]  # fmt: skip

    pre = [
        lin("patch_embed", tok, io, H),
        lin("t_embed.fc1", B * T, T_EMBED_DIM, H),
        lin("t_embed.fc2", B * T, H, H),
    ]
    block = [lin("adaLN", B * T, H, 6 * H), ln("norm1"), lin("qkv", tok, H, 3 * H)]
    if attention == "full":
        block += [*attn("self", B, N), lin("attn_out", tok, H, H)]
    else:
        block += [*attn("space", B * T, S), lin("attn_out", tok, H, H), ln("norm_time"),
                  lin("time_qkv", tok, H, 3 * H), *attn("time", B * S, T),
                  lin("time_out", tok, H, H)]  # fmt: skip
    if text_len:
        block += [lin("cross_q", tok, H, H), lin("cross_kv", txt, H, 2 * H),
                  OpCost(st, "cross_attn", MATMUL, 4.0 * B * N * text_len * H, 0.0,
                         (2 * tok + 2 * txt) * H * ab),
                  lin("cross_out", tok, H, H)]  # fmt: skip
    block += [ln("norm2"), lin("fc1", tok, H, Fm),
              elementwise(st, "gelu", tok * Fm, flops_per_element=GELU_FLOPS, ab=ab),
              lin("fc2", tok, Fm, H)]  # fmt: skip
    post = [lin("final_adaLN", B * T, H, 2 * H), ln("final_norm"), lin("unpatchify", tok, H, io)]
    ops = [*pre, *(op.times(depth, count=depth) for op in block), *post]
    for op in ops:
        op.batch, op.context = B, N
        op.evaluate(hw, a)
    return VideoDiTReport(hardware=hw, act_dtype=a, weight_dtype=w, frames=frames,
                          latent=(latent_h, latent_w, channels), patch=(patch_t, patch), attention=attention,
                          hidden=H, depth=depth, heads=heads, text_len=text_len, steps=steps, cfg=cfg,
                          batch=batch,
                          tokens=N, ops=ops, step=totals(ops))  # fmt: skip


def frames_sweep(frame_counts: list[int], **kwargs: Any) -> list[dict[str, Any]]:
    """Attention share, per-step time and bound vs clip length, full and factorised."""
    rows = []
    for f in frame_counts:
        row: dict[str, Any] = {"frames": f}
        for mode in ("full", "factorized"):
            rep = video_dit_cost(f, attention=mode, **kwargs)
            row[mode] = {"attention_share": rep.attention_share, "step_time_s": rep.step.time_s,
                         "intensity": json_number(rep.step.intensity), "bound": rep.step.bound}  # fmt: skip
        row["tokens"] = rep.tokens
        rows.append(row)
    return rows


def batch_sweep(batches: list[int], **kwargs: Any) -> list[dict[str, Any]]:
    """Per-clip latency and clips/s at each batch: flat throughput once compute-bound."""
    rows = []
    for b in batches:
        rep = video_dit_cost(batch=b, **kwargs)
        clip_s = rep.total_time_s
        rows.append({"batch": b, "latency_s": clip_s, "clips_per_s": b / clip_s, "bound": rep.step.bound,
                     "intensity": json_number(rep.step.intensity)})  # fmt: skip
    return rows


__all__ = ["VideoDiTReport", "batch_sweep", "frames_sweep", "video_dit_cost"]
