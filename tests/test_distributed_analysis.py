"""The analyzer's communication model for tensor / expert parallelism (no processes started)."""

from __future__ import annotations

import pytest

from forwardpass.analysis.parallel import INTERCONNECTS, get_interconnect, step_communication
from forwardpass.errors import ConfigError
from forwardpass.models.model_spec import ModelSpec

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
}


def test_all_reduce_bytes_and_time_on_nvlink():
    spec = ModelSpec.from_config(LLAMA_8B)
    comm = step_communication(spec, 8, tokens=256, sampled=256, dtype_bytes=2, interconnect="nvlink4")
    payload = 256 * 4096 * 2  # [T, hidden] in bf16
    assert comm.all_reduces == 65  # embedding + 2 per layer
    assert comm.all_reduce_payload == 65 * payload
    assert comm.all_reduce_traffic == 65 * (2 * 7 * payload // 8)  # ring: 2(N-1)/N of the payload
    assert comm.logits_gather == 7 * 256 * (128256 // 8) * 4
    link = INTERCONNECTS["nvlink4"]
    bandwidth_time = (comm.all_reduce_traffic + comm.logits_gather) / link.bandwidth
    assert bandwidth_time < comm.time_s < bandwidth_time + 65 * 14 * link.latency + link.latency + 1e-12
    assert comm.all_to_all_alternative == 0  # dense


def test_slower_links_take_longer_and_tp1_sends_nothing():
    spec = ModelSpec.from_config(LLAMA_8B)
    times = [
        step_communication(spec, 2, 64, interconnect=name).time_s for name in ("nvlink4", "pcie5", "ib-ndr")
    ]
    assert times == sorted(times)
    assert step_communication(spec, 1, 64).time_s == 0
    assert get_interconnect(None, "a100").name == "nvlink3" and get_interconnect(None, "l4").name == "pcie4"
    with pytest.raises(ConfigError):
        get_interconnect("carrier-pigeon")


def test_moe_reports_the_all_to_all_alternative():
    cfg = {
        **LLAMA_8B,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "head_dim": 128,
    }
    spec = ModelSpec.from_config(cfg)
    comm = step_communication(spec, 4, tokens=100, expert_parallel=True)
    # dispatch + combine of every token's hidden state to its 8 experts, 3/4 of them on other ranks
    assert comm.all_to_all_alternative == 2 * len(spec.moe.layer_ids) * 100 * 8 * 4096 * 2 * 3 // 4
    assert comm.all_to_all_alternative > comm.all_reduce_traffic  # why the engine all-reduces


def test_roofline_cli_prints_the_communication_of_tp(capsys):
    import json

    from forwardpass.cli import main

    assert (
        main(["roofline", "llama-3-8b", "--hardware", "a100", "--tp", "4", "--batch", "1,8", "--json"]) == 0
    )
    rows = json.loads(capsys.readouterr().out)["communication"]
    assert [r["step"] for r in rows] == ["prefill", "decode x1", "decode x8"]
    assert all(r["interconnect"] == "nvlink3" and r["all_reduces"] == 65 for r in rows)  # A100: NVLink 3
