"""``forwardpass explain``: the JSON from a real run, the funnel, the views against the engine, the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from forwardpass.analysis.hardware import get_hardware
from forwardpass.analysis.overhead import Overhead, predict_step
from forwardpass.cli import main
from forwardpass.explain import explain
from forwardpass.llm import LLM
from forwardpass.sampling.params import SamplingParams

PROMPT = "Elizabeth walked unhurriedly to"
TOP_K, TOP_P, SEED, N = 20, 0.9, 7, 6
OH = Overhead(per_step_s=2e-3, per_layer_s=2e-4)


@pytest.fixture(scope="module")
def llm():
    return LLM(None)


@pytest.fixture(scope="module")
def cli_json():
    """``forwardpass explain ... --json`` on the embedded model, parsed."""
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["explain", PROMPT, "--max-tokens", str(N), "--temperature", "0.8", "--top-k", str(TOP_K),
                   "--top-p", str(TOP_P), "--seed", str(SEED), "--ignore-eos", "--hardware", "h100",
                   "--no-overhead", "--json"])
    assert rc == 0
    return json.loads(buf.getvalue())


def test_json_has_the_documented_fields(cli_json):
    ex = cli_json
    assert {"tokens", "prefill", "decode", "layers", "roofline"} <= set(ex)
    assert all({"id", "text"} <= set(t) for t in ex["tokens"])
    assert {"tokens", "kv_entries", "time_s", "flops", "bytes", "bound"} <= set(ex["prefill"])
    for d in ex["decode"]:
        assert {"token", "text", "kv_entries", "candidates", "time_s", "flops", "bytes", "bound"} <= set(d)
        assert d["flops"] > 0 and d["bytes"] > 0 and d["time_s"] > 0
    assert "unhurriedly" in "".join(t["text"] for t in ex["tokens"])
    assert any(t["split"] for t in ex["tokens"])  # "unhurriedly" is several tokens in this vocabulary
    assert len(ex["layers"]) == ex["engine"]["layers"] + 1
    # the plain engine's: fp32 weights, packed or on the small-batch kernel where compiled
    plan = ex["execution_plan"]
    assert (plan["device"], plan["dtype"]) == ("cpu", "float32")
    assert plan["weights"]["dense"] == ("fp32+small-matmul" if plan["small_matmul"] else "fp32")
    fp32 = ("fp32-packed", "fp32+small-matmul") if plan["small_matmul"] else ("fp32",)
    assert plan["weights"]["projection"] in fp32


def test_kv_entries_fill_at_prefill_then_grow_by_one(cli_json):
    ex = cli_json
    p = len(ex["tokens"])
    assert ex["prefill"]["tokens"] == p and ex["prefill"]["kv_entries"] == p
    assert len(ex["decode"]) == N - 1  # the prefill drew the first token
    assert [d["kv_entries"] for d in ex["decode"]] == [p + i for i in range(1, N)]


def test_funnel_pool_respects_top_k_and_top_p_and_holds_the_drawn_token(cli_json):
    for d in [cli_json["prefill"], *cli_json["decode"]]:
        pool = d["candidates"]
        assert 1 <= d["pool_size"] <= TOP_K and len(pool) == d["pool_size"]
        probs = [c["prob"] for c in pool]
        assert probs == sorted(probs, reverse=True) and sum(probs) == pytest.approx(1.0, abs=1e-6)
        assert d["token"] in {c["token"] for c in pool}
        for row in d["funnel"]:
            assert (row["pool_prob"] > 0) == (row["min_p"] and row["top_k"] and row["top_p"])
        assert d["verified"] is True


def test_top_p_pool_is_the_smallest_set_reaching_top_p():
    ex = explain(PROMPT, max_tokens=4, temperature=1.0, top_k=0, top_p=0.5, seed=3, ignore_eos=True,
                 hardware=None, overhead=None)
    for d in [ex["prefill"], *ex["decode"]]:
        mass = [c["temp_prob"] for c in d["candidates"]]
        assert len(mass) == d["pool_size"]
        assert sum(mass) >= 0.5 - 1e-6 and sum(mass) - min(mass) < 0.5
        assert d["token"] in {c["token"] for c in d["candidates"]}


def test_drawn_tokens_equal_generate_with_the_same_seed(cli_json, llm):
    params = SamplingParams(max_tokens=N, temperature=0.8, top_k=TOP_K, top_p=TOP_P, seed=SEED,
                            ignore_eos=True)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    drawn = [cli_json["prefill"]["token"], *(d["token"] for d in cli_json["decode"])]
    assert drawn == list(out.token_ids)
    assert [g["id"] for g in cli_json["generated"]] == drawn
    assert cli_json["verified"] is True


def test_views_are_the_models_own_forward(llm):
    from forwardpass.explain.views import layer_views

    model = llm.engine.model
    ids = llm.get_tokenizer().encode(PROMPT)
    v = layer_views(model, ids, [len(ids) - 1], layer=2, head=1)
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), None)
        logits = model.compute_logits(hidden[-1:])
    torch.testing.assert_close(v.final_hidden, hidden)
    torch.testing.assert_close(v.logits, logits.float())
    w = torch.tensor(v.attention)
    assert torch.allclose(w.sum(-1), torch.ones(len(ids)), atol=1e-5)
    assert bool((w.triu(1) == 0).all())  # the causal mask


def test_greedy_pool_is_one_token_and_overhead_bound_shows(llm):
    ex = explain(PROMPT, engine=llm.engine, max_tokens=3, temperature=0, hardware=get_hardware("h100"),
                 overhead=OH)
    for d in [ex["prefill"], *ex["decode"]]:
        assert d["pool_size"] == 1 and d["candidates"][0]["token"] == d["token"]
        assert d["bound"] == "overhead"  # a 6-layer toy model on an H100: launches dominate
        assert d["overhead_s"] == pytest.approx(OH.time_s(6))


def _built_methods(model: torch.nn.Module) -> dict[str, set[str]]:
    """The weight method each linear layer of ``model`` was built with, by role."""
    from forwardpass.layers.linear import Linear

    out: dict[str, set[str]] = {}
    for m in model.modules():
        if isinstance(m, Linear):
            out.setdefault(m.role, set()).add(m.method.name)
    return out


def test_execution_plan_is_the_engines(llm):
    """``execution_plan`` is the plan of the engine that ran the request: an int8 engine's q8_0 weights, the
    plain engine's fp32 ones, each as its model's linear layers were built; the terminal
    view has it in one line."""
    import io

    from rich.console import Console

    from forwardpass.explain.terminal import render
    from forwardpass.layers.weight_report import describe_plan
    from forwardpass.quant.weight import QuantizedWeight

    q8 = LLM(None, quantization="int8", cpu_kernels=False)
    for engine, quantized in ((q8.engine, True), (llm.engine, False)):
        ex = explain(PROMPT, engine=engine, max_tokens=2, seed=1, hardware=None, overhead=None)
        plan = ex["execution_plan"]
        assert json.loads(json.dumps(plan)) == plan
        assert {k: v for k, v in plan.items() if k != "loaded_weights"} == describe_plan(engine.core.plan)
        assert set(plan["loaded_weights"]) == {"projections", "lm_head"}  # what the weights really are
        built = _built_methods(engine.model)
        assert {role: {plan["weights"][role]} for role in built} == built
        if quantized:
            assert plan["weights"] == {"projection": "q8_0", "lm_head": "q8_0", "dense": "fp32"}
            assert plan["isa"]["quant_matmul"] and plan["isa"]["quant_gemm"]
            assert not (plan["decode_kernel"] or plan["small_matmul"])  # cpu_kernels=False
            assert any(isinstance(getattr(m, "weight", None), QuantizedWeight)
                       for m in engine.model.modules())
            buf = io.StringIO()
            render(ex, out=Console(file=buf, width=400))
            line = next(x for x in buf.getvalue().splitlines() if x.startswith("execution plan:"))
            assert line.startswith("execution plan: cpu float32 · weights projections Q8_0 via the "
                                   "quantized-matmul kernel"), line
            assert "lm head Q8_0 via the quantized-matmul kernel" in line and "· KV cache float32 ·" in line
            assert "quant_matmul=" in line
        else:
            assert plan["weights"]["projection"].startswith("fp32")


def test_three_term_prediction_names_the_largest():
    assert predict_step(1e12, 1e6, 1, 1e12, 1e12, OH).bound == "compute"
    assert predict_step(1e3, 1e12, 1, 1e12, 1e12, OH).bound == "memory"
    p = predict_step(1e3, 1e3, 10, 1e12, 1e12, OH)
    assert p.bound == "overhead" and p.time_s == pytest.approx(OH.time_s(10) + 1e-9)


def test_moe_routing_per_token_and_layer(tmp_path):
    from tests.helpers.moe_checkpoints import make_moe_checkpoint

    ckpt = make_moe_checkpoint(tmp_path / "moe", "qwen3_moe_k2_norm")
    ex = explain([5, 9, 11, 4], model=ckpt, max_tokens=3, seed=1, ignore_eos=True, hardware=None,
                 overhead=None)
    assert ex["routing"], "an MoE model reports routing"
    for r in ex["routing"]:
        assert len(r["experts"]) == 4 + 3 - 1 and all(len(e) == 2 for e in r["experts"])
        # the run's own counts
        assert r["matches_engine"], (r["tokens_per_expert"], r["engine_tokens_per_expert"])
    assert [d["kv_entries"] for d in ex["decode"]] == [5, 6]


def test_html_report_opens_in_the_browser(cli_json, tmp_path):
    from forwardpass.explain.html import render_html
    from tests.helpers.browser import assert_not_blank, browser, console_errors

    path = tmp_path / "report.html"
    path.write_text(render_html(cli_json), encoding="utf-8")
    assert "http" not in path.read_text().replace("http://www.w3.org/2000/svg", "")  # self-contained
    driver = browser()
    try:
        driver.get(path.as_uri())
        assert driver.title == "forwardpass explain"
        assert driver.find_element("id", "completion").text.strip()
        assert len(driver.find_elements("css selector", "svg")) >= 4
        assert not console_errors(driver)
        shot = Path("test-artifacts") / "explain-report.png"
        shot.parent.mkdir(exist_ok=True)
        driver.save_screenshot(str(shot))
        assert_not_blank(shot)
    finally:
        driver.quit()


def test_explain_image_teacher_and_student(tmp_path):
    """The latent resolving: decoded frames, 2 denoiser passes per step with CFG (1 for the student)."""
    from forwardpass.explain.image import explain_image, render_image_html, strip_image, to_json

    torch.set_num_threads(1)
    ex = explain_image("a handwritten 7", steps=6, frames=4, hardware="h100", overhead=OH)
    teacher, student = ex["runs"]
    assert teacher["cfg"] and teacher["passes_per_step"] == 2 and teacher["forward_passes"] == 12
    assert [s["passes_total"] for s in teacher["per_step"]] == [2, 4, 6, 8, 10, 12]
    assert not student["cfg"] and student["forward_passes"] == student["steps"] == len(student["per_step"])
    shown = [f["step"] for f in teacher["strip"]]
    assert len(shown) == 4 and shown[0] == 1 and shown[-1] == 6
    assert [f["step"] for f in student["strip"]] == list(range(1, student["steps"] + 1))
    # the latent resolves: its spread at the last frame is far from the initial noise's
    assert teacher["strip"][-1]["latent_std"] != pytest.approx(teacher["strip"][0]["latent_std"], rel=0.05)
    assert all(s["bound"] == "overhead" for s in teacher["per_step"])  # a toy DiT on an H100
    json.dumps(to_json(ex))
    assert strip_image(ex).size[1] == 2 * (32 * 4 + 4)
    assert render_image_html(ex).count("data:image/png;base64,") == 4 + 1 + student["steps"] + 1


def test_terminal_view_shows_every_section(cli_json):
    import io

    from rich.console import Console

    from forwardpass.explain.terminal import render

    buf = io.StringIO()
    render(cli_json, out=Console(file=buf, width=160))
    text = buf.getvalue()
    for needle in ("prompt tokens", "prefill", "decode steps", "KV cache", "sampling funnel",
                   "hidden-state norm", "attention of layer", "roofline", "draws reproduced: True"):
        assert needle in text, needle


def test_batching_sweep_shows_intensity_rising_with_the_batch(llm):
    """``--batching``: the prompt decoded beside copies of itself; each batch size's pure decode steps, whose
    FLOP per byte (the analyzer's accounting of the steps the engine ran) rises with the batch, and the view
    in the terminal, the JSON and the HTML report."""
    import io

    from rich.console import Console

    from forwardpass.explain.html import render_html
    from forwardpass.explain.terminal import render

    ex = explain(PROMPT, engine=llm.engine, max_tokens=2, seed=1, hardware="h100", overhead=None,
                 batch_sizes=(1, 4, 16))
    rows = ex["batching"]
    assert [r["batch"] for r in rows] == [1, 4, 16] and all(r["steps"] >= 3 for r in rows)
    assert rows[0]["intensity"] < rows[1]["intensity"] < rows[2]["intensity"]
    assert all(r["achieved_flops_per_s"] > 0 and r["mfu"] is not None for r in rows)
    assert not llm.engine.has_unfinished_requests()  # the copies are gone
    buf = io.StringIO()
    render(ex, out=Console(file=buf, width=200))
    assert "batching raises arithmetic intensity" in buf.getvalue()
    assert "<table id=batching>" in render_html(ex)
    assert explain(PROMPT, engine=llm.engine, max_tokens=1, hardware=None, overhead=None)["batching"] is None
