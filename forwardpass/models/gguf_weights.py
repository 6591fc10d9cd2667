"""A GGUF file's weights into the model built from its spec (``loader/gguf.py`` made the model directory).

Each tensor goes where it computes, from its bytes as stored (no requantization):

* F32 / F16 / BF16 → fp32 values;
* Q8_0 / Q4_0 → a ``QuantizedWeight`` (the Q8_0/Q4_0 kernels read GGUF's values and fp16 scales as they are);
* Q4_1, Q5_0, Q5_1, Q2_K..Q6_K, and a Q8_0 LM head → a ``KBlockWeight`` (codes and scales unpacked by
  ``quant/gguf_blocks.py``, repacked by ``quant/kblocks.py``: the same numbers, laid out for the K-block
  kernel).

A merged projection (q/k/v, gate/up) whose parts share one quantized type is one weight; parts of different
K-block types (Q4_K_M files keep some ``attn_v`` in Q8_0 or Q6_K) a ``KBlockStack`` (one kernel call, each
part at its file's bits), other mixes a ``RowStack``, each part on its own kernel. Llama's
q/k rows are stored permuted for GGML's interleaved rotary layout; we undo it on the rows of bytes, as
transformers' reader does on the values.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from forwardpass.errors import ConfigError
from forwardpass.quant import gguf_blocks, kblocks


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """GGML's interleaved rotary rows → HF's rotate-half rows (rows only; works on rows of block bytes)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class _Tensor:
    """One GGUF tensor: its type name, ``k`` weights per row, and its rows as bytes (``raw`` uint8
    [rows, bytes])."""

    def __init__(self, t):
        self.name, self.kind = t.name, t.tensor_type.name
        self.k = int(t.shape[0])
        self.rows = int(np.prod([int(d) for d in t.shape[1:]])) if len(t.shape) > 1 else 1
        self.vector = len(t.shape) == 1
        with warnings.catch_warnings():  # a read-only memory map: everything below copies out of it
            warnings.simplefilter("ignore", UserWarning)
            self.raw = torch.from_numpy(np.ascontiguousarray(t.data).view(np.uint8).reshape(self.rows, -1))

    def rows_permuted(self, n_head: int) -> _Tensor:
        self.raw = _unpermute(self.raw, n_head)
        return self

    @property
    def is_float(self) -> bool:
        return self.kind in gguf_blocks.FLOAT_TYPES

    def float(self) -> torch.Tensor:
        w = gguf_blocks.dequantize(self.kind, self.raw, self.k)
        return w.reshape(-1) if self.vector else w


def _weight(parts: list[_Tensor]):
    """The weight of rows ``parts`` stacked, all of one quantized type: a QuantizedWeight or a
    KBlockWeight."""
    from forwardpass.quant.kblock_weight import KBlockWeight
    from forwardpass.quant.weight import QuantizedWeight

    kind, k = parts[0].kind, parts[0].k
    raw = torch.cat([p.raw for p in parts]) if len(parts) > 1 else parts[0].raw
    if kind in ("Q8_0", "Q4_0"):
        size = 34 if kind == "Q8_0" else 18
        blocks = raw.view(raw.shape[0], k // 32, size)
        d = blocks[..., :2].contiguous().view(torch.float16).reshape(raw.shape[0], k // 32)
        qs = blocks[..., 2:].reshape(raw.shape[0], -1).contiguous()
        return QuantizedWeight(qs if kind == "Q4_0" else qs.view(torch.int8), d, kind.lower(), k)
    spec = kblocks.KINDS[kind.lower()]
    return KBlockWeight(spec, *kblocks.pack(spec, gguf_blocks.unpack(kind, raw, k)))


def _head_weight(t: _Tensor):
    """The LM head's weight (a tied embedding's too): a Q8_0 head as a K-block Q8_0 matrix (the same bytes,
    tiled by 16 rows), whose kernel takes a speculative verify step's extra activation rows for less than
    the Q8_0 row kernel does (benchmarks/speculative.py prints the verify step's cost); the head is a fifth
    of a small model's step. Many rows (prompt logprobs) multiply in fp32: bf16 rounding of the activations
    flips near-tied logits (SmolLM2 Q4_1, 256 teacher-forced tokens, top-1 agreement with transformers'
    fp32: 96.9% in bf16, 99.2% in fp32; tests/test_smollm2.py). Other types as :func:`_weight` holds them."""
    from forwardpass.quant.kblock_weight import KBlockWeight

    if t.kind != "Q8_0":
        return _weight([t])
    spec = kblocks.KINDS["q8_0"]
    return KBlockWeight(spec, *kblocks.pack(spec, gguf_blocks.unpack(t.kind, t.raw, t.k)), bf16_gemm=False)


def _set_weight(module: nn.Module, parts: list[_Tensor]) -> None:
    """Give linear layer ``module`` the rows of ``parts`` stacked: fp32 values where all are float, one
    quantized weight where all share a quantized type, else a RowStack of each part's own weight."""
    from forwardpass.quant.kblock_weight import RowStack

    kinds = {p.kind for p in parts}
    if all(p.is_float for p in parts):
        w = torch.cat([p.float() for p in parts]) if len(parts) > 1 else parts[0].float()
        module.weight.data.copy_(w.reshape(module.weight.shape))
        return
    if len(kinds) > 1 and all(p.kind.lower() in kblocks.KINDS for p in parts):  # Q5_0 q/k, Q8_0 v (Q4_K_M)
        from forwardpass.quant.kblock_weight import KBlockStack  # each part at its file's bits, one call

        packed = kblocks.pack_stack([(kblocks.KINDS[p.kind.lower()], gguf_blocks.unpack(p.kind, p.raw, p.k))
                                     for p in parts])  # fmt: skip
        module.method.load_blocks(module, KBlockStack(*packed))
        return
    if len(kinds) > 1 and kinds <= set(gguf_blocks.AS_Q8_0):  # Q4_0 beside Q8_0: Q8_0, exactly
        for p in parts:
            p.raw, p.kind = gguf_blocks.to_q8_0(p.kind, p.raw, p.k), "Q8_0"
        kinds = {"Q8_0"}
    if len(kinds) == 1:
        module.method.load_blocks(module, _weight(parts))  # held as stored (layers/weight_methods.py)
        return
    module.method.load_blocks(module, RowStack([p.float() if p.is_float else _weight([p]) for p in parts]))


def load_gguf_model(
    model_dir: str | os.PathLike[str], dtype: torch.dtype = torch.float32, device: str = "cpu"
):
    """``(model, spec)`` for a directory made by ``loader/gguf.py::gguf_model_dir``, weights read from its
    GGUF file."""
    from forwardpass.loader import gguf_checks
    from forwardpass.loader.config import load_model_config
    from forwardpass.loader.gguf import gguf_file
    from forwardpass.models.loading import build_model
    from forwardpass.models.model_spec import ModelSpec

    if dtype != torch.float32 or not str(device).startswith("cpu"):
        raise ConfigError(
            "GGUF models run on CPU in float32 (their quantized weights use the CPU kernels)", param="dtype"
        )
    path = gguf_file(model_dir)
    # again: a directory made before these checks, or a file replaced since (before anything is built)
    reader, arch = gguf_checks.check_file(path)
    spec = ModelSpec.from_config(load_model_config(Path(model_dir)), name=path.name)
    tensors = {t.name: t for t in reader.tensors}

    def get(name: str) -> _Tensor:
        if name not in tensors:
            raise ConfigError(f"GGUF file lacks tensor {name}", param="model")
        return _Tensor(tensors[name])

    model = build_model(spec, dtype, device)
    llama = arch == "llama"
    with torch.no_grad():
        inner = model.model
        emb = get("token_embd.weight")
        if spec.tied and not emb.is_float:  # the LM head's blocks as stored; lookups dequantize their rows
            embed = inner.embed_tokens
            embed.head_method.load_blocks(embed, _head_weight(emb))
        else:
            inner.embed_tokens.weight.data.copy_(emb.float())
        if not spec.tied:
            head = get("output.weight")
            if head.is_float:
                _set_weight(model.lm_head, [head])
            else:
                model.lm_head.method.load_blocks(model.lm_head, _head_weight(head))
        inner.norm.weight.copy_(get("output_norm.weight").float())
        for i, layer in enumerate(inner.layers):
            b = f"blk.{i}"
            attn = layer.self_attn
            layer.input_layernorm.weight.copy_(get(f"{b}.attn_norm.weight").float())
            layer.post_attention_layernorm.weight.copy_(get(f"{b}.ffn_norm.weight").float())
            q, k, v = get(f"{b}.attn_q.weight"), get(f"{b}.attn_k.weight"), get(f"{b}.attn_v.weight")
            if llama:
                q, k = q.rows_permuted(spec.heads), k.rows_permuted(spec.kv_heads)
            _set_weight(attn.qkv_proj, [q, k, v])
            if attn.qkv_proj.bias is not None:
                qb, kb = get(f"{b}.attn_q.bias").float(), get(f"{b}.attn_k.bias").float()
                if llama:
                    qb, kb = _unpermute(qb, spec.heads), _unpermute(kb, spec.kv_heads)
                attn.qkv_proj.bias.copy_(torch.cat([qb, kb, get(f"{b}.attn_v.bias").float()]))
            _set_weight(attn.o_proj, [get(f"{b}.attn_output.weight")])
            if attn.q_norm is not None:
                attn.q_norm.weight.copy_(get(f"{b}.attn_q_norm.weight").float())
                attn.k_norm.weight.copy_(get(f"{b}.attn_k_norm.weight").float())
            _set_weight(layer.mlp.gate_up_proj, [get(f"{b}.ffn_gate.weight"), get(f"{b}.ffn_up.weight")])
            _set_weight(layer.mlp.down_proj, [get(f"{b}.ffn_down.weight")])
    return model, spec
