"""The decode step's layers in one C++ call (``forwardpass/models/llama_decode_stack.py``): the same kernels
as the modules in the same order, so the tokens *and* their log-probabilities are bitwise those of the module
path, for every weight format and the Llama family's switches (q/k norms, qkv bias, sliding windows, rope
scaling, batches of sequences at different lengths); and the engine builds it only where every layer is
exactly what it computes."""

from __future__ import annotations

import pytest

from forwardpass import LLM, SamplingParams
from tests.helpers.checkpoints import random_prompts


@pytest.fixture(scope="module")
def ops():
    from forwardpass.attention import cpu_kernel

    if cpu_kernel.load_paged_decode() is None:
        pytest.skip("no C++ toolchain: the engine uses the PyTorch path")
    return cpu_kernel.fused_ops_for(cpu_kernel.load_paged_decode())


class CountingStack:
    """Wraps the engine's stack to count the steps it ran (a test that never used it would prove nothing)."""

    def __init__(self, stack):
        self.stack, self.calls = stack, 0

    def applies(self, *args):
        return self.stack.applies(*args)

    def __call__(self, *args):
        self.calls += 1
        return self.stack(*args)


def stack_and_module_runs(llm, prompts, params):
    """Each prompt's (tokens, logprobs) with the engine's decode stack (counted) and with the modules, and the
    number of steps the stack ran."""
    decoder = llm.engine.model.model
    counting = CountingStack(decoder.decode_stack)
    runs = {}
    for name, stack in (("stack", counting), ("modules", None)):
        decoder.decode_stack = stack
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[name] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    return runs["stack"], runs["modules"], counting.calls


@pytest.mark.parametrize("quantization,kv_cache_dtype", [(None, "auto"), ("int8", "auto"), ("int4", "auto"),
                                                         (None, "float16"), ("int8", "float16")])  # fmt: skip
@pytest.mark.parametrize("variant", ["qwen3", "qwen2", "mistral", "llama"])
def test_stack_equals_the_modules_bitwise(ops, checkpoint_factory, variant, quantization, kv_cache_dtype):
    # qwen3: q/k norms, tied head; qwen2: q/k/v biases, one KV head; mistral: a 48-token sliding window
    # (the contexts below pass it); llama: llama3 rope scaling, an untied head
    llm = LLM(checkpoint_factory(variant), quantization=quantization, num_kv_blocks=64, block_size=16,
              cpu_kernels=True, enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    assert llm.engine.model.model.decode_stack is not None
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    with_stack, with_modules, calls = stack_and_module_runs(llm, random_prompts(3, [9, 40, 63]), params)
    assert calls >= 15  # every decode step of the batch
    assert with_stack == with_modules  # tokens and log-probabilities, exactly


def test_large_batches_and_mixed_steps_take_the_modules(ops, checkpoint_factory):
    import torch

    from forwardpass.attention.context import AttentionContext

    llm = LLM(checkpoint_factory("qwen3"), num_kv_blocks=32, cpu_kernels=True)
    stack = llm.engine.model.model.decode_stack
    x, cos = torch.zeros(4, 64), torch.zeros(4, 32)
    ctx = AttentionContext(kv_caches=[], groups=[], layer_group=[], num_decode=4,
                           decode_kernel=ops.paged_decode)
    assert stack.applies(x, cos, ctx)
    assert not stack.applies(x, cos, AttentionContext([], [], [], num_decode=3,
                                                      decode_kernel=ops.paged_decode))
    assert not stack.applies(x, cos, None)  # no cache: scoring / parity runs
    rows = stack.max_rows + 1
    big = AttentionContext([], [], [], num_decode=rows, decode_kernel=ops.paged_decode)
    assert not stack.applies(torch.zeros(rows, 64), torch.zeros(rows, 32), big)


def test_not_built_where_a_layer_differs(ops, checkpoint_factory, tmp_path):
    from tests.helpers.attention_checkpoints import make_attention_checkpoint
    from tests.helpers.moe_checkpoints import make_moe_checkpoint

    def stack_of(path, **kw):
        return getattr(LLM(path, num_kv_blocks=32, **kw).engine.model.model, "decode_stack", None)

    assert stack_of(checkpoint_factory("qwen3"), cpu_kernels=False) is None  # the PyTorch path
    # a bfloat16 cache is not one of them: the paged kernel and the K/V store read and write it
    assert stack_of(checkpoint_factory("qwen3"), cpu_kernels=True, kv_cache_dtype="bfloat16") is not None
    assert stack_of(checkpoint_factory("qwen3"), cpu_kernels=True, enable_lora=True, max_lora_rank=8) is None
    assert stack_of(make_moe_checkpoint(tmp_path / "moe", "qwen3_moe_k2_norm"), cpu_kernels=True) is None
    assert stack_of(make_attention_checkpoint(tmp_path / "g2", "gemma2"), cpu_kernels=True) is None


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_large_quantized_batches_run_in_the_stack_where_the_kernel_takes_them(ops, checkpoint_factory,
                                                                              quantization):
    """On AVX-512 VNNI CPUs the kernel multiplies batches of any size (the tile layout's small-batch kernel,
    its GEMM from gemm_rows on: quant/csrc/tiles.h, vnni_gemm.h); the stack takes 32+ rows too, still bitwise
    the modules. Elsewhere such batches run the modules (they take another GEMM: AMX, oneDNN)."""
    from forwardpass.quant.weight import QuantizedWeight

    llm = LLM(checkpoint_factory("qwen3"), quantization=quantization, num_kv_blocks=256, block_size=16,
              cpu_kernels=True, enable_prefix_caching=False, max_num_seqs=40)  # fmt: skip
    decoder = llm.engine.model.model
    vnni = any(w._vnni is not None for w in decoder.modules() if isinstance(w, QuantizedWeight))
    assert (decoder.decode_stack.max_rows >= 40) == vnni
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    with_stack, with_modules, calls = stack_and_module_runs(llm, random_prompts(40, [5, 17, 33]), params)
    assert with_stack == with_modules
    assert (calls > 0) == vnni  # decode steps of all 40 sequences
