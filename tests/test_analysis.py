"""Bottleneck analyzer: hardware table, per-op roofline, attention kernels, DiT, CLI, plots, --measure.

Fast: no test runs the this-machine microbenchmark (a fake measurement is injected) except the one
marked slow.
"""

from __future__ import annotations

import json
import math
from typing import ClassVar

import pytest

from forwardpass.analysis import hardware as hwmod
from forwardpass.analysis.attention import attention_cost, compare_kernels, formula_naive_intensity
from forwardpass.analysis.diffusion import dit_cost, parse_size
from forwardpass.analysis.hardware import Hardware, get_hardware
from forwardpass.analysis.presets import PRESETS
from forwardpass.analysis.roofline import analyze, causal_pairs
from forwardpass.errors import ConfigError, ForwardpassError, MissingFileError, ModelNotFoundError
from forwardpass.models.model_spec import ModelSpec

MiB = 2**20
FAKE_MEASUREMENT = {
    "read_bandwidth": 37.5e9,
    "fp32_matmul_flops": 98e9,
    "capacity": 24 * 2**30,
    "cores": 2,
    "cpu": "fake EPYC",
    "measured_at": "2026-01-01T00:00:00",
    "method": "fake",
}


@pytest.fixture
def fake_cache(tmp_path, monkeypatch):
    """XDG cache pointing at tmp_path holding a fake this-machine measurement; measuring is forbidden."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(hwmod, "_cores", lambda: 2)

    def no_benchmark(**_):
        raise AssertionError("the microbenchmark must not run in fast tests")

    monkeypatch.setattr(hwmod, "measure_this_machine", no_benchmark)
    hwmod.save_measurement(dict(FAKE_MEASUREMENT))
    from forwardpass.analysis import overhead as ohmod

    monkeypatch.setattr(ohmod, "measure_overhead", no_benchmark)
    doc = json.loads(hwmod.cache_path().read_text())
    doc["overhead-cpu"] = FAKE_OVERHEAD.to_dict()
    hwmod.cache_path().write_text(json.dumps(doc))
    return tmp_path


def _fake_overhead():
    from forwardpass.analysis.overhead import PATH, Overhead

    # a cached value of the current probe
    return Overhead(per_step_s=1e-3, per_layer_s=1e-4, method=f"fake, {PATH}")


FAKE_OVERHEAD = _fake_overhead()


def fake_machine() -> Hardware:
    return hwmod.hardware_from_measurement(dict(FAKE_MEASUREMENT))


# ----- hardware -----------------------------------------------------------------------------------
def test_h100_ridge_is_about_295():
    h100 = get_hardware("h100")
    assert h100.peak("bf16") == pytest.approx(989e12, rel=1e-3)
    assert h100.bandwidth == pytest.approx(3.35e12)
    assert h100.ridge("bf16") == pytest.approx(989 / 3.35, rel=2e-3)
    assert h100.ridge("bf16") == pytest.approx(295, abs=1)
    assert h100.ridge("fp8") == pytest.approx(2 * h100.ridge("bf16"), rel=1e-3)


def test_spec_table_lists_every_device_with_a_source():
    for name in ("a100-80gb-sxm", "h100-sxm", "h200", "b200", "l4", "l40s", "mi300x"):
        h = get_hardware(name)
        assert h.source and h.bandwidth > 0 and h.capacity > 0
        assert h.ridge("bf16") == pytest.approx(h.peak("bf16") / h.bandwidth)
    # A100 has no FP8 tensor cores: fp8 compute falls back to bf16
    assert get_hardware("a100").compute_dtype("fp8") == "bf16"


def test_unknown_hardware_lists_the_known_ones():
    with pytest.raises(ConfigError) as exc:
        get_hardware("tpu-v9")
    msg = str(exc.value)
    assert "tpu-v9" in msg and "h100" in msg and "mi300x" in msg and "this-machine" in msg


def test_this_machine_reads_the_cache(fake_cache):
    h = get_hardware("this-machine")
    assert h.bandwidth == 37.5e9 and h.peak("fp32") == 98e9
    assert h.default_dtype == "fp32"
    assert h.measured_at == "2026-01-01T00:00:00"
    assert (fake_cache / "forwardpass" / "hardware.json").is_file()


def test_this_machine_measures_once_and_caches_with_the_date(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def fake_measure(**_):
        calls.append(1)
        return {**FAKE_MEASUREMENT, "cores": hwmod._cores(), "measured_at": "2026-02-02T10:00:00"}

    monkeypatch.setattr(hwmod, "measure_this_machine", fake_measure)
    first = get_hardware("this-machine")
    second = get_hardware("this-machine")
    assert len(calls) == 1 and first.bandwidth == second.bandwidth == 37.5e9
    cached = json.loads((tmp_path / "forwardpass" / "hardware.json").read_text())
    assert cached["this-machine"]["measured_at"] == "2026-02-02T10:00:00"
    get_hardware("this-machine", remeasure=True)
    assert len(calls) == 2


# ----- attention kernels --------------------------------------------------------------------------
def test_naive_attention_materialises_32_mib_s_and_p():
    naive = attention_cost(4096, 4096, 128, heads=1, dtype="fp16", impl="naive")
    assert naive.s_bytes == 32 * MiB  # S, and P of the same size
    assert naive.sp_traffic_bytes == 4 * 32 * MiB  # S written, read; P written, read
    assert naive.matmul_intensity == pytest.approx(formula_naive_intensity(4096, 128))
    assert formula_naive_intensity(4096, 128) == pytest.approx(62.06, abs=0.01)
    assert naive.intensity == pytest.approx(62, rel=0.02)  # softmax FLOPs add ~1%


def test_fused_attention_intensity_is_n_over_2():
    fused = attention_cost(4096, 4096, 128, heads=1, dtype="fp16", impl="fused")
    assert fused.s_bytes == 0 and fused.sp_traffic_bytes == 0
    assert fused.bytes == 4 * 4096 * 128 * 2  # Q, K, V read once, O written once
    assert fused.matmul_intensity == pytest.approx(4096 / 2)
    assert fused.intensity == pytest.approx(4096 / 2, rel=0.02)


def test_decode_attention_intensity_is_about_one_per_query_head_sharing_a_kv_head():
    mha = attention_cost(1, 4096, 128, heads=32, kv_heads=32, dtype="fp16")
    gqa = attention_cost(1, 4096, 128, heads=32, kv_heads=8, dtype="fp16")
    assert mha.intensity == pytest.approx(1, rel=0.03)
    assert gqa.intensity == pytest.approx(4, rel=0.03)
    rows = compare_kernels(4096, 128, hardware="h100")
    assert [r.impl for r in rows] == ["naive", "fused", "decode"]
    assert [r.bound for r in rows] == ["memory", "compute", "memory"]


def test_attention_rejects_bad_shapes():
    with pytest.raises(ConfigError):
        attention_cost(128, 128, 64, heads=6, kv_heads=4)
    with pytest.raises(ConfigError):
        attention_cost(128, 128, 64, dtype="int4")


# ----- LLM roofline -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama():
    return analyze("llama-3-8b", "h100", prefill_tokens=2048, context=4096, batches=(1, 8, 64))


def test_llama_3_8b_shape(llama):
    assert llama.params == pytest.approx(8.03e9, rel=0.005)
    assert llama.weight_dtype == llama.act_dtype == llama.kv_dtype == "bf16"
    assert llama.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2


def test_llama_decode_batch_1_is_weight_bandwidth_bound(llama):
    d1 = llama.decode_at(1)
    weight_time = llama.weight_bytes / 3.35e12
    assert weight_time == pytest.approx(4.8e-3, rel=0.01)
    assert d1.time_s == pytest.approx(weight_time, rel=0.05)
    assert d1.bound == "memory"
    assert d1.tokens_per_s == pytest.approx(1 / d1.time_s)


def test_llama_prefill_is_compute_bound(llama):
    assert llama.prefill.bound == "compute"
    assert llama.prefill.tokens == 2048
    # ~2 FLOPs per parameter per token, plus attention
    assert llama.prefill.total.flops > 2 * 7e9 * 2048


def test_llama_crossover_near_ridge_times_bytes_per_weight_over_2(llama):
    assert llama.crossover_estimate == pytest.approx(295, abs=1)
    assert 0.9 * 295 <= llama.crossover_batch <= 1.2 * 295
    bf = analyze("llama-3-8b", "h100", batches=(1,), weight_dtype="int8", act_dtype="bf16")
    assert bf.crossover_estimate == pytest.approx(295 / 2, abs=1)


def test_decode_kv_traffic_uses_kv_heads(llama):
    for d in llama.decode:
        assert d.total.kv_read_bytes == d.batch * 4096 * 2 * 32 * 8 * 128 * 2
        assert d.total.kv_write_bytes == d.batch * llama.kv_bytes_per_token
        # weights are read once per step for the whole batch
        assert d.total.weight_bytes == pytest.approx(llama.decode_at(1).total.weight_bytes, rel=1e-3)
    tps = [d.tokens_per_s for d in llama.decode]
    assert tps == sorted(tps)


def test_lm_head_costs_2_hidden_vocab_per_token(llama):
    for d in llama.decode:
        (head,) = [o for o in d.ops if o.name == "lm_head"]
        assert head.flops == 2 * 4096 * 128256 * d.batch


def test_max_batch_fits_the_memory_budget(llama):
    free = 0.9 * 80e9 - llama.weight_bytes
    assert llama.max_batch == int(free // (llama.kv_bytes_per_token * 4096))
    tight = analyze("llama-3-8b", "h100", batches=(1,), memory_budget=10e9)
    assert tight.max_batch == 0  # 16 GB of weights do not fit in 10 GB


def test_dtypes_change_bytes_not_flops():
    bf = analyze("llama-3-8b", "h100", batches=(1,))
    q4 = analyze("llama-3-8b", "h100", batches=(1,), weight_dtype="int4", kv_dtype="fp8")
    assert q4.act_dtype == "bf16" and q4.kv_dtype == "fp8"
    assert q4.decode[0].total.flops == pytest.approx(bf.decode[0].total.flops)
    assert q4.decode[0].total.weight_bytes == pytest.approx(bf.decode[0].total.weight_bytes / 4)
    assert q4.decode[0].total.kv_read_bytes == pytest.approx(bf.decode[0].total.kv_read_bytes / 2)
    with pytest.raises(ConfigError, match="fp32, bf16"):
        analyze("llama-3-8b", "h100", weight_dtype="int3")
    with pytest.raises(ConfigError):
        analyze("llama-3-8b", "h100", act_dtype="int4")


def test_moe_counts_only_active_experts():
    rep = analyze("qwen3-30b-a3b", "h100", batches=(1, 4096))
    s = rep.shape
    assert (s.moe.num_experts, s.moe.experts_per_tok, s.moe_layers) == (128, 8, 48)
    assert rep.params == pytest.approx(30.5e9, rel=0.01)
    assert rep.active_params == pytest.approx(3.35e9, rel=0.01)
    d1 = rep.decode_at(1)
    experts = [o for o in d1.ops if o.name.startswith("experts.") and o.kind == "matmul"]
    assert len(experts) == 3
    for o in experts:
        assert o.flops == 48 * 8 * 2 * 2048 * 768  # k experts per token, per layer
        assert o.weight_bytes == pytest.approx(48 * 8 * 2048 * 768 * 2)  # only the 8 touched experts
    # the whole step reads the active weights (minus the unread embedding table), not all 30B
    active_read = (rep.active_params - s.embedding_params) * 2
    assert d1.total.weight_bytes == pytest.approx(active_read, rel=0.01)
    # each expert sees B·k/E tokens: the crossover moves out by E/k
    assert rep.crossover_estimate == pytest.approx(295 * 128 / 8, rel=0.01)
    assert 0.7 * rep.crossover_estimate <= rep.crossover_batch <= 1.3 * rep.crossover_estimate
    # a large batch touches (nearly) every expert
    big = rep.decode_at(4096)
    (gate,) = [o for o in big.ops if o.name == "experts.gate_proj"]
    assert gate.weight_bytes == pytest.approx(48 * 128 * 2048 * 768 * 2, rel=1e-3)


def test_mixtral_and_mlp_only_layers():
    mix = analyze("mixtral-8x7b", "h100", batches=(1,))
    assert mix.params == pytest.approx(46.7e9, rel=0.01)
    assert mix.active_params == pytest.approx(12.9e9, rel=0.01)
    cfg = dict(PRESETS["qwen3-30b-a3b"], mlp_only_layers=[0, 1], decoder_sparse_step=2)
    shape = ModelSpec.from_config(cfg)
    assert shape.moe_layers == len([i for i in range(48) if i not in (0, 1) and (i + 1) % 2 == 0])
    rep = analyze(cfg, "h100", batches=(1,))
    assert {"gate_proj", "experts.gate_proj", "router"} <= {o.name for o in rep.decode[0].ops}


def test_sliding_window_caps_kv_reads():
    rep = analyze("mistral-7b", "h100", context=8192, batches=(1,))
    assert rep.decode[0].total.kv_read_bytes == 4096 * rep.kv_bytes_per_token


def test_mixed_sliding_layers_are_averaged_over_layers():
    # Qwen-style: layers from max_window_layers on slide, the first 14 attend to everything
    cfg = dict(PRESETS["qwen3-0.6b"], use_sliding_window=True, sliding_window=1024, max_window_layers=14)
    spec = ModelSpec.from_config(cfg)
    assert spec.layer_windows == (None,) * 14 + (1024,) * 14 and spec.sliding_window is None
    rep = analyze(cfg, "h100", prefill_tokens=4096, context=8192, batches=(1,))
    assert rep.decode[0].total.kv_read_bytes == (8192 + 1024) / 2 * rep.kv_bytes_per_token
    (scores,) = [o for o in rep.prefill.ops if o.name == "attn_scores"]
    pairs = (causal_pairs(4096) + causal_pairs(4096, 1024)) / 2
    assert scores.flops == pytest.approx(28 * 2 * 16 * 128 * pairs)


def test_naive_attention_costs_more_bytes_in_prefill():
    fused = analyze("qwen3-0.6b", "h100", prefill_tokens=4096, batches=(1,))
    naive = analyze("qwen3-0.6b", "h100", prefill_tokens=4096, batches=(1,), attention="naive")
    assert naive.prefill.total.bytes > 4 * fused.prefill.total.bytes  # S and P: 16 heads x 4096^2 x 2 B x 4
    assert naive.prefill.time_s > fused.prefill.time_s


def test_this_machine_defaults_to_fp32():
    rep = analyze("qwen3-0.6b", fake_machine(), prefill_tokens=128, context=192, batches=(1, 16))
    assert (rep.weight_dtype, rep.act_dtype, rep.kv_dtype) == ("fp32", "fp32", "fp32")
    d1 = rep.decode_at(1)
    # ~2.4 GB of fp32 weights per token at 37.5 GB/s → ~15.7 tok/s at most (read bandwidth measured on the
    # development machine)
    assert d1.total.weight_bytes == pytest.approx(2.38e9, rel=0.02)
    assert d1.tokens_per_s == pytest.approx(15.7, rel=0.08)
    assert d1.bound == "memory"


def test_report_json_has_the_documented_fields(llama):
    doc = json.loads(json.dumps(llama.to_dict(), allow_nan=False))
    assert {"name", "peak_flops", "bandwidth", "ridge"} <= set(doc["hardware"])
    assert {"tokens", "flops", "bytes", "time_s", "bound"} <= set(doc["prefill"])
    for d in doc["decode"]:
        assert {"batch", "context", "flops", "bytes", "intensity", "time_s", "tokens_per_s", "bound"} <= set(
            d
        )
    for o in doc["ops"]:
        assert {"stage", "name", "flops", "bytes", "intensity", "bound", "time_s"} <= set(o)
    assert {o["stage"] for o in doc["ops"]} == {"prefill", "decode"}
    assert doc["kv_bytes_per_token"] == 131072
    assert doc["hardware"]["ridge"] == pytest.approx(295, abs=1)


def test_config_from_a_model_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["qwen3-0.6b"]))
    by_dir = analyze(tmp_path, "h100", batches=(1,))
    by_file = analyze(tmp_path / "config.json", "h100", batches=(1,))
    by_name = analyze("qwen3-0.6b", "h100", batches=(1,))
    assert by_dir.params == by_file.params == by_name.params
    assert by_dir.decode[0].time_s == pytest.approx(by_name.decode[0].time_s)


def test_bad_model_paths_raise_forwardpass_errors(tmp_path):
    with pytest.raises(MissingFileError):
        analyze(tmp_path, "h100")
    with pytest.raises(ModelNotFoundError, match="llama-3-8b"):
        analyze(tmp_path / "nope", "h100")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4}))
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        analyze(tmp_path, "h100")
    with pytest.raises(ConfigError):
        analyze("llama-3-8b", "h100", batches=(0,))


# ----- diffusion ----------------------------------------------------------------------------------
def test_dit_cfg_doubles_the_passes_and_steps_multiply():
    kw = {"latent_channels": 4, "patch_size": 2, "hidden": 256, "depth": 6, "heads": 4, "text_len": 16,
          "mlp_ratio": 4.0, "steps": 30}  # fmt: skip
    with_cfg = dit_cost(8, 8, cfg=True, **kw)
    without = dit_cost(8, 8, cfg=False, **kw)
    assert with_cfg.tokens == 16
    assert with_cfg.passes_per_step == 2
    assert with_cfg.step.flops == pytest.approx(2 * without.step.flops)
    assert with_cfg.step.weight_bytes == pytest.approx(without.step.weight_bytes)  # one batched pass
    assert with_cfg.total_flops == pytest.approx(30 * with_cfg.step.flops)
    assert with_cfg.total_time_s == pytest.approx(30 * with_cfg.step.time_s)


def test_dit_xl_2_parameter_count_and_flops():
    # DiT-XL/2 (no text): 675 M params, ~119 GFLOPs per 256x256 image forward (32x32 latent)
    rep = dit_cost(32, 32, 4, 2, 1152, 28, 16, text_len=0, mlp_ratio=4.0, steps=1, cfg=False)
    assert rep.params == pytest.approx(675e6, rel=0.01)
    assert rep.step.flops / 2 == pytest.approx(119e9, rel=0.05)  # the paper counts multiply-adds
    with pytest.raises(ConfigError):
        dit_cost(9, 9, 4, 2, 256, 2, 4)
    assert parse_size("64x32") == (64, 32)


# ----- plots --------------------------------------------------------------------------------------
def test_plot_writes_a_png_with_the_agg_canvas(tmp_path, llama):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from forwardpass.analysis.plot import plot_report

    path = tmp_path / "roofline.png"
    fig = plot_report(llama, path)
    assert isinstance(fig.canvas, FigureCanvasAgg)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert any(lbl.startswith("ridge") for lbl in labels)
    assert "prefill" in labels and "decode b=1" in labels


def test_plot_labels_never_print_over_each_other(llama):
    from forwardpass.analysis.plot import plot_report

    fig = plot_report(llama)
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    boxes = [t.get_window_extent(renderer) for t in ax.texts]
    assert len(boxes) >= 4  # prefill and decode ops are labelled
    inside = ax.get_window_extent(renderer)
    for i, a in enumerate(boxes):
        assert inside.x0 <= a.x0 and a.x1 <= inside.x1 and inside.y0 <= a.y0 and a.y1 <= inside.y1
        assert not any(a.overlaps(b) for b in boxes[i + 1 :]), ax.texts[i].get_text()


# ----- CLI ----------------------------------------------------------------------------------------
def _cli(capsys, *argv):
    from forwardpass.cli import main

    rc = main(["roofline", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_json(capsys):
    rc, out, _ = _cli(capsys, "llama-3-8b", "--hardware", "h100", "--batch", "1,8", "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["hardware"]["name"] == "h100"
    assert [d["batch"] for d in doc["decode"]] == [1, 8]
    assert doc["prefill"]["tokens"] == 2048 and doc["prefill"]["bound"] == "compute"


def test_cli_tables_and_plot(capsys, tmp_path):
    png = tmp_path / "r.png"
    rc, out, _ = _cli(capsys, "qwen3-30b-a3b", "--hardware", "h200", "--batch", "1,64", "--plot", str(png))
    assert rc == 0
    assert "Prefill ops" in out and "experts.gate_proj" in out and "ridge" in out
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_cli_this_machine(capsys, fake_cache):
    rc, out, _ = _cli(capsys, "qwen3-0.6b", "--hardware", "this-machine", "--prefill", "128", "--context",
                      "192", "--batch", "1", "--json")  # fmt: skip
    doc = json.loads(out)
    assert rc == 0 and doc["dtypes"] == {"weight": "fp32", "activation": "fp32", "kv": "fp32"}
    assert doc["hardware"]["bandwidth"] == 37.5e9
    # the third bound: the cached overhead is added to each stage, and this tiny batch is overhead-bound
    stages = doc["overhead"]["stages"]
    assert doc["overhead"]["measured"]["per_layer_s"] == FAKE_OVERHEAD.per_layer_s
    oh_s = FAKE_OVERHEAD.time_s(28)  # qwen3-0.6b has 28 layers
    assert all(r["overhead_s"] == pytest.approx(oh_s) for r in stages)
    assert all(r["time_s"] == pytest.approx(r["roofline_s"] + oh_s) for r in stages)
    rc, out, _ = _cli(capsys, "qwen3-0.6b", "--hardware", "this-machine", "--prefill", "128", "--context",
                      "192", "--batch", "1", "--brief")  # fmt: skip
    assert rc == 0 and "third bound" in out


def test_cli_attention_and_dit(capsys, tmp_path):
    rc, out, _ = _cli(capsys, "attention", "--n", "4096", "--d", "128", "--json")
    kernels = {k["impl"]: k for k in json.loads(out)["kernels"]}
    assert rc == 0 and kernels["naive"]["s_bytes"] == 32 * MiB
    assert kernels["fused"]["intensity"] == pytest.approx(2048, rel=0.02)
    rc, out, _ = _cli(capsys, "attention", "--n", "1024", "--d", "64", "--heads", "8", "--kv-heads", "2")
    assert rc == 0 and "naive" in out and "fused" in out and "decode" in out
    rc, out, _ = _cli(capsys, "dit", "--latent", "8x8", "--patch", "2", "--width", "256", "--depth", "6",
                      "--heads", "4", "--text-len", "16", "--steps", "30", "--cfg", "--json")  # fmt: skip
    doc = json.loads(out)
    assert rc == 0 and doc["passes_per_step"] == 2 and doc["tokens"] == 16
    assert doc["total"]["flops"] == pytest.approx(30 * doc["step"]["flops"])


def test_cli_hardware_table_and_public_api(capsys):
    rc, out, _ = _cli(capsys, "hardware", "--json")
    names = [h["name"] for h in json.loads(out)]
    assert rc == 0 and names == ["a100", "h100", "h200", "b200", "l4", "l40s", "mi300x"]
    import forwardpass
    from forwardpass.analysis import roofline

    assert forwardpass.analyze is roofline.analyze


def test_cli_bad_input_is_a_clear_error(capsys, tmp_path):
    rc, _, err = _cli(capsys, "llama-3-8b", "--hardware", "tpu")
    assert rc == 1 and "unknown hardware" in err and "h100" in err
    rc, _, err = _cli(capsys, "llama-3-8b", "--kv-dtype", "fp4")
    assert rc == 1 and "kv dtype" in err
    rc, _, err = _cli(capsys, str(tmp_path))
    assert rc == 1 and "config.json" in err


# ----- --measure ----------------------------------------------------------------------------------
class FakeLLM:
    """Stands in for forwardpass.LLM on a fake clock: prefill 0.5 ms per prompt token,
    decode 2 ms per step."""

    instances: ClassVar[list] = []
    clock: ClassVar[list[float]] = [0.0]

    def __init__(self, model, **kwargs):
        self.kwargs = kwargs
        self.seen: list = []
        FakeLLM.instances.append(self)

    def generate(self, prompts, params, use_tqdm=True):
        self.seen.append([tuple(p) for p in prompts])
        FakeLLM.clock[0] += 0.0005 * len(prompts[0]) + 0.002 * (params.max_tokens - 1)
        return []


def test_measure_compares_predicted_and_measured(tmp_path, fake_cache, monkeypatch):
    from types import SimpleNamespace

    from forwardpass.explain import measure as measure_mod

    monkeypatch.setattr(measure_mod, "time", SimpleNamespace(perf_counter=lambda: FakeLLM.clock[0]))
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["qwen3-0.6b"]))
    res = measure_mod.measure(
        tmp_path, batches=[1, 2], prompt_tokens=8, new_tokens=5, runs=1, llm_factory=FakeLLM
    )
    llm = FakeLLM.instances[-1]
    assert llm.kwargs["dtype"] == "float32" and llm.kwargs["enable_prefix_caching"] is False
    prompts = [p for call in llm.seen for p in call]
    assert len(set(prompts)) == len(prompts)  # never the same prompt twice: no cache hits
    rows = {(r["batch"], r["metric"]): r for r in res.rows}
    assert res.timings[1]["method"] == "wall-difference"
    dec = rows[(1, "decode tok/s")]
    assert dec["measured"] == pytest.approx(1 / 0.002)
    assert rows[(2, "decode tok/s")]["measured"] == pytest.approx(2 / 0.002)
    assert rows[(1, "prefill tok/s")]["measured"] == pytest.approx(8 / (0.0005 * 8))
    assert dec["ratio"] == pytest.approx(dec["measured"] / dec["predicted"])
    assert rows[(2, "decode tok/s")]["predicted"] > dec["predicted"]
    with pytest.raises(ModelNotFoundError):
        measure_mod.measure("qwen3-0.6b", llm_factory=FakeLLM)


class FakeStatsLLM:
    """An LLM with per-step records: one prefill step of 0.1 s, then decode steps of 0.05 s each."""

    def __init__(self, model, **kwargs):
        from types import SimpleNamespace

        self.engine = SimpleNamespace(stats=[])

    def generate(self, prompts, params, use_tqdm=True):
        from types import SimpleNamespace

        b, p = len(prompts), len(prompts[0])
        rec = self.engine.stats
        rec.append(SimpleNamespace(duration_s=0.1, num_prefill_tokens=b * p, num_decode_tokens=0))
        for _ in range(params.max_tokens - 1):
            rec.append(SimpleNamespace(duration_s=0.05, num_prefill_tokens=0, num_decode_tokens=b))
        return []


def test_measure_uses_engine_step_records(tmp_path, fake_cache):
    from forwardpass.explain.measure import measure

    (tmp_path / "config.json").write_text(json.dumps(PRESETS["qwen3-0.6b"]))
    res = measure(tmp_path, batches=[4], prompt_tokens=16, new_tokens=6, runs=2, llm_factory=FakeStatsLLM)
    rows = {r["metric"]: r for r in res.rows}
    assert res.timings[4]["method"] == "step-stats"
    assert rows["prefill tok/s"]["measured"] == pytest.approx(4 * 16 / 0.1)
    assert rows["decode tok/s"]["measured"] == pytest.approx(4 / 0.05)
    assert res.timings[4]["tpot_s"] == pytest.approx(0.05)


def test_measure_without_engine_says_so(tmp_path, fake_cache, monkeypatch):
    import importlib.util

    from forwardpass.explain import measure as measure_mod

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "forwardpass.llm" else real(n, *a)
    )
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["qwen3-0.6b"]))
    with pytest.raises(ForwardpassError, match="forwardpass.llm"):
        measure_mod.measure(tmp_path)


# ----- slow: the real microbenchmark --------------------------------------------------------------
@pytest.mark.slow
def test_microbenchmark_measures_plausible_figures():
    data = hwmod.measure_this_machine(read_mib=256, matmul_n=1024, repeats=3)
    assert 1e9 < data["read_bandwidth"] < 1e12
    assert 1e9 < data["fp32_matmul_flops"] < 1e14
    assert math.isfinite(data["read_bandwidth"]) and data["measured_at"]


def test_measure_adds_the_overhead_bound_and_states_its_settings(tmp_path, fake_cache):
    """The third bound: predicted = roofline + measured overhead; the table says what it ran."""
    import io

    from rich.console import Console

    from forwardpass.analysis.report import render_measure
    from forwardpass.explain.measure import measure

    (tmp_path / "config.json").write_text(json.dumps(PRESETS["qwen3-0.6b"]))
    res = measure(tmp_path, batches=[4], prompt_tokens=16, new_tokens=6, runs=2, llm_factory=FakeStatsLLM)
    layers = res.reports[4].shape.layers
    oh_s = FAKE_OVERHEAD.time_s(layers)
    assert res.settings["overhead_per_step_s"] == pytest.approx(oh_s)
    for row in res.rows:
        stage = res.reports[4].prefill if row["metric"].startswith("prefill") else res.reports[4].decode[0]
        assert row["predicted"] == pytest.approx(stage.tokens / (stage.time_s + oh_s))
        assert row["roofline_only"] == pytest.approx(stage.tokens_per_s)
        assert row["bound"] == ("overhead" if oh_s > stage.time_s else stage.bound)
    buf = io.StringIO()
    render_measure(res.rows, out=Console(file=buf, width=200), settings=res.settings)
    text = buf.getvalue()
    for needle in ("prompt 16 tokens", "6 new tokens", "median of 2 runs", "overhead", "bound"):
        assert needle in text
    no_oh = measure(tmp_path, batches=[4], prompt_tokens=16, new_tokens=6, runs=1, llm_factory=FakeStatsLLM,
                    overhead=None)
    assert all(r["predicted"] == pytest.approx(r["roofline_only"]) for r in no_oh.rows)


def test_measured_points_sit_beside_the_predicted_ones(tmp_path, fake_cache):
    from forwardpass.analysis.overhead import measured_points
    from forwardpass.analysis.plot import plot_report
    from forwardpass.explain.measure import measure

    (tmp_path / "config.json").write_text(json.dumps(PRESETS["qwen3-0.6b"]))
    res = measure(tmp_path, batches=[2], prompt_tokens=16, new_tokens=6, runs=1, llm_factory=FakeStatsLLM)
    pts = measured_points(res)
    assert {p.stage for p in pts} == {"predicted", "measured"} and len(pts) == 4
    fig = plot_report(res.reports[2], tmp_path / "roofline.png", pts)
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert "measured" in labels and "predicted (roofline + overhead)" in labels
    assert (tmp_path / "roofline.png").stat().st_size > 10_000


def test_an_overhead_cached_from_another_probe_path_is_measured_again(tmp_path, monkeypatch):
    from forwardpass.analysis import overhead as ohmod

    path = tmp_path / "hardware.json"
    # module path
    old = ohmod.Overhead(per_step_s=2e-4, per_layer_s=5e-4, method="median of ... interleaved runs")
    path.write_text(json.dumps({"overhead-cpu": old.to_dict()}))
    monkeypatch.setattr(ohmod, "measure_overhead", lambda device: FAKE_OVERHEAD)
    assert ohmod.this_machine_overhead("cpu", path=path).per_layer_s == FAKE_OVERHEAD.per_layer_s
    assert json.loads(path.read_text())["overhead-cpu"]["method"] == FAKE_OVERHEAD.method
    assert ohmod.this_machine_overhead("cpu", path=path) == FAKE_OVERHEAD  # now from the cache
