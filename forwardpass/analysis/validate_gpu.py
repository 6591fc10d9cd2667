"""Check the analyzer's predictions on a CUDA GPU:
``python -m forwardpass.analysis.validate_gpu [--spec h200]``.

Measures the device's ceilings (read bandwidth, bf16 8192³ matmul), then times, with CUDA-graph replay:

* the linear layers (+ SiLU·up and the LM head) of a Llama-3-8B-shaped decode step at several batch
  sizes, random bf16 weights, no attention — against the analyzer's sum over the same ops, on the spec
  sheet and on the measured ceilings;
* attention for N = 4096, d = 128, 32 heads, fp16: naive (S and P materialised) and fused (SDPA), and a
  GQA decode step (64 sequences × 4096 positions, 32 query / 8 KV heads) — against ``attention_cost``.

Prints a table and writes JSON to ``$OUT/gpu_check.json`` (or ``--out``). Takes about a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

LINEAR_OPS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "act", "down_proj", "lm_head")


def main() -> None:
    import torch
    import torch.nn.functional as F

    from forwardpass.analysis.attention import attention_cost
    from forwardpass.analysis.hardware import Hardware, get_hardware
    from forwardpass.analysis.roofline import analyze

    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="h200")
    ap.add_argument("--batches", default="1,8,32,64,128,192,256,384,512,1024,2048")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_check.json"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    spec = get_hardware(args.spec)

    def timed(fn, iters: int = 20, warm: int = 3) -> float:
        for _ in range(warm):
            fn()
        times = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return statistics.median(times)

    def graphed(fn):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return g.replay

    # ---- ceilings
    def ceilings() -> tuple[float, float, float]:
        x = torch.randn(1 << 30, device=dev, dtype=torch.bfloat16)  # 2 GiB
        y = torch.empty_like(x)
        read_bw = x.numel() * 2 / timed(x.sum)
        copy_bw = 2 * x.numel() * 2 / timed(lambda: y.copy_(x))
        a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        return read_bw, copy_bw, 2 * 8192**3 / timed(lambda: a @ b)

    read_bw, copy_bw, mm = ceilings()
    torch.cuda.empty_cache()
    measured = Hardware(
        "measured",
        f"{torch.cuda.get_device_name()} (measured)",
        flops={"bf16": mm, "fp16": mm},
        vector_flops=spec.vector_flops,
        bandwidth=max(read_bw, copy_bw),
        capacity=spec.capacity,
    )
    out: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "read_bandwidth": read_bw,
        "copy_bandwidth": copy_bw,
        "bf16_matmul_flops": mm,
        "spec": spec.to_dict("bf16"),
    }
    print(f"{out['device']}: read {read_bw / 1e12:.2f} TB/s, copy {copy_bw / 1e12:.2f} TB/s (r+w), "
          f"bf16 matmul {mm / 1e12:.0f} TFLOP/s; spec {spec.bandwidth / 1e12:.2f} TB/s, "
          f"{spec.peak('bf16') / 1e12:.0f} TFLOP/s")  # fmt: skip

    # ---- Llama-3-8B-shaped decode linear layers
    H, KV, I, V, L = 4096, 1024, 14336, 128256, 32
    batches = [int(v) for v in args.batches.split(",")]
    pred_spec = analyze("llama-3-8b", spec, prefill_tokens=16, context=1, batches=batches)
    pred_meas = analyze("llama-3-8b", measured, prefill_tokens=16, context=1, batches=batches)

    def decode_linear() -> list[dict]:
        bf = torch.bfloat16
        shapes = {"q": (H, H), "k": (KV, H), "v": (KV, H), "o": (H, H), "g": (I, H), "u": (I, H), "d": (H, I)}
        layers = [
            {n: torch.randn(o, i, device=dev, dtype=bf) * 0.02 for n, (o, i) in shapes.items()}
            for _ in range(L)
        ]
        lm = torch.randn(V, H, device=dev, dtype=bf) * 0.02
        rows = []
        print(
            f"\n{'batch':>6} {'measured':>10} {'pred spec':>10} {'pred meas':>10} {'meas/spec':>9} "
            f"{'TB/s':>6} {'TFLOP/s':>8}"
        )
        for B in batches:
            xin = torch.randn(B, H, device=dev, dtype=bf)

            def step(xin=xin):
                h = xin
                for w in layers:
                    q = F.linear(h, w["q"])
                    F.linear(h, w["k"])
                    F.linear(h, w["v"])
                    o = F.linear(q, w["o"])
                    act = F.silu(F.linear(o, w["g"])) * F.linear(o, w["u"])
                    h = F.linear(act, w["d"])
                return F.linear(h, lm)

            t = timed(graphed(step))
            ops = [op for op in pred_spec.decode_at(B).ops if op.name in LINEAR_OPS]
            ps = sum(op.time_s for op in ops)
            pm = sum(op.time_s for op in pred_meas.decode_at(B).ops if op.name in LINEAR_OPS)
            flops, nbytes = sum(o.flops for o in ops), sum(o.bytes for o in ops)
            rows.append({"batch": B, "measured_s": t, "predicted_spec_s": ps, "predicted_measured_s": pm,
                         "flops": flops, "bytes": nbytes})  # fmt: skip
            print(f"{B:>6} {t * 1e3:>8.3f}ms {ps * 1e3:>8.3f}ms {pm * 1e3:>8.3f}ms {t / ps:>9.2f} "
                  f"{nbytes / t / 1e12:>6.2f} {flops / t / 1e12:>8.1f}")  # fmt: skip
        return rows

    out["decode_linear"] = decode_linear()
    out["crossover_batch_spec"] = pred_spec.crossover_batch
    out["crossover_batch_measured_ceilings"] = pred_meas.crossover_batch
    torch.cuda.empty_cache()

    # ---- attention kernels
    N, d, nh = 4096, 128, 32
    q, k, v = (torch.randn(1, nh, N, d, device=dev, dtype=torch.float16) for _ in range(3))
    scale = d**-0.5

    def naive():
        s = (q @ k.transpose(-1, -2)) * scale
        return torch.softmax(s, dim=-1) @ v

    att = []
    for impl, fn in (("naive", naive), ("fused", lambda: F.scaled_dot_product_attention(q, k, v))):
        t = timed(graphed(fn))
        c = attention_cost(N, N, d, heads=nh, dtype="fp16", impl=impl).evaluate(spec)
        att.append(
            {"impl": impl, "measured_s": t, "predicted_s": c.time_s, "bytes": c.bytes, "flops": c.flops}
        )
    Bd, Ld, nkv = 64, 4096, 8
    qd = torch.randn(Bd, nh, 1, d, device=dev, dtype=torch.float16)
    kd, vd = (torch.randn(Bd, nkv, Ld, d, device=dev, dtype=torch.float16) for _ in range(2))
    t = timed(graphed(lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)))
    c = attention_cost(1, Ld, d, heads=nh, kv_heads=nkv, dtype="fp16").evaluate(spec)
    att.append({"impl": f"decode x{Bd}", "measured_s": t, "predicted_s": Bd * c.time_s, "bytes": Bd * c.bytes,
                "flops": Bd * c.flops})  # fmt: skip
    print(f"\n{'attention':>12} {'measured':>10} {'predicted':>10} {'ratio':>6} {'TB/s':>6} {'TFLOP/s':>8}")
    for r in att:
        print(f"{r['impl']:>12} {r['measured_s'] * 1e3:>8.3f}ms {r['predicted_s'] * 1e3:>8.3f}ms "
              f"{r['measured_s'] / r['predicted_s']:>6.2f} {r['bytes'] / r['measured_s'] / 1e12:>6.2f} "
              f"{r['flops'] / r['measured_s'] / 1e12:>8.1f}")  # fmt: skip
    out["attention"] = att
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
