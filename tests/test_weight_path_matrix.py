"""The weight-path matrix (issue #38): every generating architecture × every weight path the execution plan
can pick on this CPU, each built through the real engine path (``LLM`` → ``build_engine_core`` →
``resolve_plan`` + ``prepare_model``) from a tiny random-weight checkpoint written by transformers'
``save_pretrained``.

Paths (``docs/weight-paths.md`` has the table and the knobs):

* ``fp32``: ``cpu_kernels=False``: plain fp32 weights, oneDNN / PyTorch matmuls, no compiled kernel;
* ``fp32-packed``: ``cpu_kernels=True`` (``FORWARDPASS_PACKED_WEIGHTS`` on, its default): every projection's
  and the LM head's weight packed once for oneDNN (``layers/packed.py``), decode steps on the small-batch
  kernel;
* ``int8`` / ``int4``: ``quantization=`` with the compiled kernels: projections and expert stacks ``q8_0`` /
  ``q4_0`` blocks, the LM head (or tied embedding) ``q8_0``;
* ``bf16-panels``: the same checkpoint saved in bfloat16, ``cpu_kernels=True``: every projection and the LM
  head kept in bfloat16 panels the kernel upcasts in registers (``layers/half_panels.py``); its reference is
  transformers on that bf16 checkpoint read in float32 (the same values).

Each cell checks that the plan chose the path and that it really applies (every plan-built layer's method and
what its weight became after loading; no torch ``nn.Linear`` the plan cannot reach), then runs a few greedy
steps through the engine: the fp32 paths must give transformers' greedy tokens; the quantized ones must give
tokens with finite log-probs, and their teacher-forced top-1 agreement with transformers' fp32 tokens is
reported at the end of the module (not asserted: random tiny models have close logits). The checkpoints'
widths are chosen so that the projections' output sizes are whole 64-output panels, the only condition packing
has (``layers/packed.py::PackedWeight.pack``); a weight that is not stays plain, and the test checks exactly
that.

Whisper takes every path too (its projections are plan-built ``Linear`` layers, its LM head the tied token
embedding): built from a tiny random checkpoint through the encoder-decoder engine path, the same checks of
what each weight became, transformers' greedy tokens on the fp32 paths.

Run: ``python -m pytest -q tests/test_weight_path_matrix.py`` (``-k llama``, ``-k int4``,
``-k qwen3-next-fp32``). The compiled kernels are built once per machine and cached (the first build takes
minutes).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from forwardpass import LLM, SamplingParams
from forwardpass.layers.embedding import TokenEmbedding
from forwardpass.layers.half_panels import HalfPanelWeight
from forwardpass.layers.linear import Linear
from forwardpass.layers.moe import ExpertWeights
from forwardpass.layers.packed import PANEL, PackedWeight
from forwardpass.layers.weight_methods import method_for
from forwardpass.models.expert_stacks import ExpertStacks
from forwardpass.models.weight_path_checks import check_weight_path
from forwardpass.plan import ExecutionPlan
from forwardpass.quant.weight import QuantizedWeight
from tests.helpers.attention_checkpoints import make_attention_checkpoint
from tests.helpers.checkpoints import bf16_copy, make_checkpoint, random_prompts
from tests.helpers.deepseek_v4_checkpoints import make_deepseek_v4_checkpoint
from tests.helpers.moe_checkpoints import make_moe_checkpoint
from tests.helpers.oracle import hf_greedy, hf_model
from tests.helpers.state_checkpoints import make_state_checkpoint

transformers = pytest.importorskip("transformers")

# q 64, kv_a 64
_MLA = {"qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "kv_lora_rank": 56, "num_hidden_layers": 2}

#: id → writes the checkpoint into a directory. Hidden 64 and vocab 512 everywhere (one panel, eight); the
#: overrides make each projection a whole number of panels where the helper's default is not
#: (listed: what stays plain)
ARCHS: dict[str, Callable[[Path], Path]] = {
    "llama": lambda d: make_checkpoint(d, "llama", num_hidden_layers=2),
    "mistral": lambda d: make_checkpoint(d, "mistral", num_hidden_layers=2),
    # q/k/v 64+32+32
    "qwen2": lambda d: make_checkpoint(d, "qwen2", num_hidden_layers=2, num_key_value_heads=2),
    "qwen3": lambda d: make_checkpoint(d, "qwen3", num_hidden_layers=2),
    "qwen3-moe": lambda d: make_moe_checkpoint(d, "qwen3_moe_k2_norm"),
    "mixtral": lambda d: make_moe_checkpoint(d, "mixtral_k2"),
    "gemma2": lambda d: make_attention_checkpoint(d, "gemma2", num_hidden_layers=2),
    "gemma3": lambda d: make_attention_checkpoint(d, "gemma3"),
    "deepseek-v2": lambda d: make_attention_checkpoint(d, "deepseek_v2", **_MLA),
    "deepseek-v3": lambda d: make_attention_checkpoint(d, "deepseek_v3", **_MLA, q_lora_rank=64),
    # plain: the indexer's weights_proj (one output per index head: 16)
    "deepseek-v4": lambda d: make_deepseek_v4_checkpoint(d, q_lora_rank=64, head_dim=64, index_head_dim=32,
                                                         moe_intermediate_size=64),
    # in_proj: 2·128 + 2·groups·state + heads = 320
    "mamba2": lambda d: make_state_checkpoint(d, "mamba2", state_size=14),
    "nemotron-h": lambda d: make_state_checkpoint(d, "nemotron_h", ssm_state_size=14,
                                                  moe_shared_expert_intermediate_size=64),
    # plain: in_proj_ba (2 per value head: 8) and shared_expert_gate (1 output)
    "qwen3-next": lambda d: make_state_checkpoint(d, "qwen3_next"),
}  # fmt: skip

#: path → the engine options that make the plan pick it, and the weight method names it gives the projections
#: and the LM head
PATHS: dict[str, tuple[dict, str, str]] = {
    "fp32": ({"cpu_kernels": False}, "fp32", "fp32"),
    "fp32-packed": ({"cpu_kernels": True}, "fp32-packed", "fp32-packed"),
    "int8": ({"cpu_kernels": True, "quantization": "int8"}, "q8_0", "q8_0"),
    "int4": ({"cpu_kernels": True, "quantization": "int4"}, "q4_0", "q8_0"),
    "bf16-panels": ({"cpu_kernels": True}, "bfloat16-panels", "bfloat16-panels"),
}
#: the paths that read the checkpoint saved in bfloat16
HALF_PATHS = {"bf16-panels"}
# 69 prefill rows: over the small-batch kernel's 64 (oneDNN's GEMM)
PROMPTS = random_prompts(2, [9, 60], seed=11)
STEPS = 6
ENGINE = {"num_kv_blocks": 32, "block_size": 16, "max_model_len": 128, "enable_prefix_caching": False}
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0)

#: (arch, path) → (top-1 agreements, positions), teacher-forced on transformers' fp32 greedy tokens
AGREEMENT: dict[tuple[str, str], tuple[int, int]] = {}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """``reference(arch, half=False) -> (checkpoint, transformers' greedy tokens for PROMPTS)``, made once per
    module; ``half``: the checkpoint saved in bfloat16, and transformers' tokens on it read in float32."""
    cache: dict[tuple[str, bool], tuple[Path, list[list[int]]]] = {}

    def get(arch: str, half: bool = False) -> tuple[Path, list[list[int]]]:
        if (arch, half) not in cache:
            path = ARCHS[arch](tmp_path_factory.mktemp(arch))
            if half:
                path = bf16_copy(path, tmp_path_factory.mktemp(f"{arch}-bf16"))
            hf = hf_model(path)
            cache[arch, half] = path, [hf_greedy(hf, p, STEPS) for p in PROMPTS]
        return cache[arch, half]

    return get


@pytest.fixture(scope="module")
def compiled_kernels():
    """Whether this machine has the compiled CPU path (built once and cached; without a C++ toolchain the
    packed path does not exist and its cells are skipped)."""
    from forwardpass.attention import cpu_kernel
    from forwardpass.layers.small_matmul import load_small_matmul

    return cpu_kernel.load_paged_decode(wait=True) is not None and load_small_matmul() is not None


class _AgreementReport:
    """Prints :data:`AGREEMENT` in pytest's terminal summary (output written from a test or
    fixture is captured)."""

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not AGREEMENT:
            return
        terminalreporter.write_sep("-", "quantized paths: teacher-forced top-1 agreement with fp32 (not "
                                        "asserted)")
        for (arch, path), (ok, n) in sorted(AGREEMENT.items()):
            terminalreporter.write_line(f"{arch}-{path}: {ok}/{n} positions pick "
                                        "transformers' fp32 greedy token")


@pytest.fixture(scope="module", autouse=True)
def agreement_report(request):
    if not request.config.pluginmanager.has_plugin("weight-path-agreement"):
        request.config.pluginmanager.register(_AgreementReport(), "weight-path-agreement")


def _onednn_lays_out_panels(out: int, k: int, method: object) -> bool:
    return PackedWeight.pack(torch.randn(out, k), getattr(method, "kernel_module", None)) is not None


def _check_weights(model: nn.Module, plan: ExecutionPlan, path: str) -> None:
    """The plan chose ``path`` and every layer took it: methods by role, and what each weight became."""
    _, projection, head = PATHS[path]
    assert method_for(plan, "projection").name == projection and method_for(plan, "lm_head").name == head
    torch_linears = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    assert not torch_linears, f"torch nn.Linear layers the plan cannot reach: {torch_linears}"
    # (name, role, outputs, inputs, weight) of each projection / LM head
    held: list[tuple[str, str, int, int, object]] = []
    for name, m in model.named_modules():
        if isinstance(m, Linear):
            assert m.method.name == method_for(plan, m.role).name, name
            if m.role == "dense":  # routers, kv_b_proj, wo_a: plain fp32 on every path
                assert isinstance(m.weight, nn.Parameter), name
            else:
                held.append((name, m.role, m.out_features, m.in_features, m.weight))
        elif isinstance(m, TokenEmbedding) and m.head_method is not None:  # a tied LM head
            assert m.head_method.name == head, name
            held.append((name, "lm_head", m.num_embeddings, m.embedding_dim, m.weight))
        elif isinstance(m, (ExpertWeights, ExpertStacks)):
            names = m.stack_names if isinstance(m, ExpertStacks) else ("gate_up_proj", "down_proj")
            for stack in names:
                w = getattr(m, stack)
                if path.startswith("int"):
                    assert isinstance(w, QuantizedWeight) and w.fmt == projection, f"{name}.{stack}"
                else:
                    assert isinstance(w, nn.Parameter), f"{name}.{stack}"
    fmt = {"lm_head": head, "projection": projection}
    packed = 0
    for name, role, out, k, w in held:
        if path == "fp32":
            assert isinstance(w, nn.Parameter), name
        elif path in HALF_PATHS:  # bf16 panels exactly where the outputs are whole panels; else fp32 as
            # packing leaves it (packed where oneDNN lays the shape out as panels, plain otherwise)
            if out % PANEL == 0:
                assert isinstance(w, HalfPanelWeight) and w.panels.dtype == torch.bfloat16, (name, type(w))
                packed += 1
            else:
                assert isinstance(w, PackedWeight | nn.Parameter), (name, type(w).__name__)
        elif path == "fp32-packed":  # packed exactly where the outputs are whole panels and oneDNN lays the
            # shape out as panels: its blocking depends on the thread count (here N=192 packs at 1 thread, not
            # at 2), so the expectation asks the same layout check for the shape
            panels = out % PANEL == 0 and _onednn_lays_out_panels(out, k, method_for(plan, role))
            assert isinstance(w, PackedWeight) == panels, (name, out, type(w).__name__)
            packed += isinstance(w, PackedWeight)
        else:
            assert isinstance(w, QuantizedWeight) and w.fmt == fmt[role], (name, type(w).__name__)
    if path == "fp32-packed" or path in HALF_PATHS:
        assert 2 * packed >= len(held), f"only {packed} of {len(held)} weights packed: widen the checkpoint"


def _lps(out) -> list[float]:
    return [next(iter(step.values())).logprob for step in out.outputs[0].logprobs]


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_weight_path(arch, path, reference, compiled_kernels, request):
    if path != "fp32" and not compiled_kernels:
        pytest.skip("no compiled CPU kernels on this machine: the plan cannot pick this path")
    ckpt, want = reference(arch, half=path in HALF_PATHS)
    options = PATHS[path][0]
    llm = LLM(str(ckpt), **ENGINE, **options)
    _check_weights(llm.engine.model, llm.engine.core.plan, path)
    quantized = path.startswith("int")
    # the quantized paths also read each prompt followed by transformers' fp32 tokens: rank 1 = same top-1
    forced = [p + w for p, w in zip(PROMPTS, want)] if quantized else []
    params = ([GREEDY] * len(PROMPTS)
              + [SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)] * len(forced))
    outs = llm.generate(PROMPTS + forced, params, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs[: len(PROMPTS)]]
    assert all(len(tokens) == STEPS for tokens in got)
    assert all(math.isfinite(lp) for o in outs[: len(PROMPTS)] for lp in _lps(o)), "non-finite logits"
    if not quantized:
        assert got == want, f"{arch}-{path}: transformers' greedy tokens {want}, the engine's {got}"
    else:
        ok = n = 0
        for prompt, o in zip(PROMPTS, outs[len(PROMPTS) :]):
            for step in o.prompt_logprobs[len(prompt) :]:
                (lp,) = step.values()
                assert math.isfinite(lp.logprob), "non-finite logits"
                ok, n = ok + (lp.rank == 1), n + 1
        AGREEMENT[arch, path] = ok, n
        request.node.user_properties.append(("top1_agreement_with_fp32", f"{ok}/{n}"))
    llm.engine.check_invariants()


# ----- Whisper: the same paths, through its encoder-decoder engine path -------------------------------------
@pytest.fixture(scope="module")
def whisper_checkpoint(tmp_path_factory):
    from tests.helpers.whisper_checkpoints import make_whisper_checkpoint

    return make_whisper_checkpoint(tmp_path_factory.mktemp("whisper"), 80, 100)  # 80 mels, a 2 s window


@pytest.fixture(scope="module")
def whisper(whisper_checkpoint, tmp_path_factory):
    """``whisper(half=False) -> (checkpoint, decoder prompt, clip, transformers' greedy tokens)``; ``half``:
    the checkpoint saved in bfloat16, transformers reading it in float32."""
    from forwardpass.audio import log_mel_spectrogram
    from tests.helpers.whisper_checkpoints import hf_greedy as whisper_greedy
    from tests.helpers.whisper_checkpoints import make_clip, prompt_ids

    cache = {}

    def get(half: bool = False):
        if half not in cache:
            ckpt = whisper_checkpoint
            if half:
                ckpt = bf16_copy(whisper_checkpoint, tmp_path_factory.mktemp("whisper-bf16"))
            hf = transformers.WhisperForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32)
            prompt, clip = prompt_ids(ckpt), make_clip(1.2, 3)
            mel = log_mel_spectrogram(clip, 80, 200)
            cache[half] = ckpt, prompt, clip, whisper_greedy(hf.eval(), mel, prompt, STEPS)
        return cache[half]

    return get


@pytest.mark.parametrize("path", list(PATHS), ids=lambda p: f"whisper-{p}")
def test_whisper_weight_path(path, whisper, compiled_kernels, request):
    """Whisper's encoder and decoder projections are plan-built ``Linear`` layers and its LM head a tied
    ``TokenEmbedding``: every path applies as to the text models (the same checks of what each weight became),
    the fp32 paths give transformers' greedy tokens, the quantized ones finite log-probs, with the
    teacher-forced agreement reported."""
    if path != "fp32" and not compiled_kernels:
        pytest.skip("no compiled CPU kernels on this machine: the plan cannot pick this path")
    ckpt, prompt, clip, want = whisper(half=path in HALF_PATHS)
    llm = LLM(str(ckpt), num_kv_blocks=32, max_num_seqs=2, **PATHS[path][0])
    plan, model = llm.engine.core.plan, llm.engine.model
    _check_weights(model, plan, path)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 2 * 6 + 2 * 10  # 2 encoder layers (q k v out fc1 fc2), 2 decoder (+ cross q k v o)
    if path.startswith("int"):  # the encoder's, the cross-attention K/V's and the decoder's weights: blocks
        assert all(isinstance(m.weight, QuantizedWeight) for m in linears)
    audio = {"multi_modal_data": {"audio": (clip, 16_000)}}
    out = llm.generate({"prompt_token_ids": prompt, **audio},
                       SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0),
                       use_tqdm=False)[0]
    assert all(math.isfinite(lp) for lp in _lps(out)), "non-finite logits"
    got = list(out.outputs[0].token_ids)
    if not path.startswith("int"):
        assert got == want, f"whisper-{path}: transformers' greedy tokens {want}, the engine's {got}"
    else:  # prompt + transformers' fp32 tokens read at once: rank 1 = the same top-1
        teacher = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        forced = llm.generate({"prompt_token_ids": prompt + want, **audio}, teacher, use_tqdm=False)[0]
        ranks = [next(iter(step.values())).rank for step in forced.prompt_logprobs[len(prompt):]]
        AGREEMENT["whisper", path] = sum(r == 1 for r in ranks), len(ranks)
        request.node.user_properties.append(("top1_agreement_with_fp32", f"{AGREEMENT['whisper', path]}"))
    llm.engine.check_invariants()


@pytest.mark.parametrize("quantization", ["int8", "int4"], ids=lambda q: f"whisper-{q}-plan")
def test_whisper_quantized_plan_is_taken(quantization, whisper_checkpoint):
    """The plan's refusal is gone: no architecture refuses a quantized path any more."""
    from forwardpass.loader.config import load_model_config
    from forwardpass.models.weight_path_checks import NOT_QUANTIZABLE
    from tests.helpers.plans import quantized_plan

    plan = quantized_plan(quantization)
    check_weight_path(load_model_config(whisper_checkpoint), plan)  # returns: Whisper takes it
    assert "WhisperForConditionalGeneration" not in NOT_QUANTIZABLE
    for arch in ("LlamaForCausalLM", "DeepseekV4ForCausalLM", "NemotronHForCausalLM"):
        check_weight_path(arch, plan)
