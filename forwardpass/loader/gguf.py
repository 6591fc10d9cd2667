"""GGUF files (llama.cpp's format) as models: ``LLM("model.gguf")``, ``--model model.gguf``.

Llama, Qwen2 and Qwen3 dense files with F32, F16, Q8_0 and Q4_0 tensors. Reading one has two halves:

* :func:`gguf_model_dir`: the file's metadata becomes a small model directory in the cache (config.json,
  tokenizer.json built from the GGUF vocabulary and merges, tokenizer_config.json with the chat template,
  generation_config.json, and ``gguf.json`` naming the file), so everything that reads a model directory
  (the spec, tokenizer, chat template, stop tokens, structured output) works unchanged;
* :func:`load_gguf_model`: the weights, read from the memory-mapped file into the model built from that
  spec. F32/F16 tensors become fp32 parameters; Q8_0/Q4_0 tensors go straight into the quantized kernels
  (``forwardpass/quant``) with their bytes as they are, no requantization.

Metadata keys and tensor names are llama.cpp's (the ``gguf`` package's constants). Llama's q/k rows are
stored permuted for GGML's interleaved rotary layout; we undo it as transformers' GGUF reader does.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from forwardpass.errors import ConfigError, ModelNotFoundError

ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
MARKER = "gguf.json"
# tokenizer.ggml.pre → the split regex in front of the byte-level BPE (GPT-2's is ByteLevel's own)
PRE_TOKENIZER_REGEX = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def _reader(path: Path):
    try:
        from gguf import GGUFReader
    except ImportError:  # pragma: no cover - a dependency, but say what to do if it is missing
        raise ModelNotFoundError("reading a .gguf file needs the gguf package: pip install gguf") from None
    return GGUFReader(str(path))


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    return value


#: the tensor types we read (F16 as fp32; Q8_0 and Q4_0 go to the quantized kernels as they are)
SUPPORTED_TYPES = ("F32", "F16", "Q8_0", "Q4_0")


def check_tensor_types(reader) -> None:
    """Refuse a file with a tensor of a type we cannot read, from its tensor infos alone (no data is read):
    before a model is built or a kernel compiled for it, not when loading reaches that tensor, minutes later."""
    bad = [t for t in reader.tensors if t.tensor_type.name not in SUPPORTED_TYPES]
    if bad:
        types = sorted({t.tensor_type.name for t in bad})
        raise ConfigError(
            f"GGUF tensor {bad[0].name} has type {bad[0].tensor_type.name}; supported: "
            f"{', '.join(SUPPORTED_TYPES)} ({len(bad)} of the file's {len(reader.tensors)} tensors are "
            f"{' or '.join(types)})",
            param="model",
        )


def _config(reader, arch: str) -> dict:
    def need(key: str):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ConfigError(f"GGUF file has no {arch}.{key}", param="model")
        return value

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    vocab = int(_field(reader, f"{arch}.vocab_size", len(tokens)))
    names = {t.name for t in reader.tensors}
    cfg = {
        "architectures": [ARCHS[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if arch == "llama" and "blk.0.attn_q.bias" in names:
        cfg["attention_bias"] = True
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    if eos is not None:
        cfg["eos_token_id"] = int(eos)
    if bos is not None:
        cfg["bos_token_id"] = int(bos)
    return cfg


def _tokenizer_files(reader, out: Path) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConfigError(
            f"GGUF tokenizer {kind!r} is not supported (byte-level BPE 'gpt2' only)", param="model"
        )
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    # every token at its id in the BPE vocabulary; control (3) and user-defined (4) tokens are also added
    # tokens (matched before BPE, by content, keeping their ids), control ones skipped when decoding
    tok = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=False)
    )
    pre = _field(reader, "tokenizer.ggml.pre", "gpt-2")  # "gpt-2", "default": ByteLevel's own regex
    if pre in PRE_TOKENIZER_REGEX:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(PRE_TOKENIZER_REGEX[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [
            AddedToken(t, special=types[i] == 3, normalized=False)
            for i, t in enumerate(tokens)
            if types[i] in (3, 4)
        ]
    )
    bos_id = _field(reader, "tokenizer.ggml.bos_token_id")
    if _field(reader, "tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[int(bos_id)]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.save(str(out / "tokenizer.json"))
    eos_id = _field(reader, "tokenizer.ggml.eos_token_id")
    pad_id = _field(reader, "tokenizer.ggml.padding_token_id")
    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[int(bos_id)] if bos_id is not None else None,
        "eos_token": tokens[int(eos_id)] if eos_id is not None else None,
        "pad_token": tokens[int(pad_id)] if pad_id is not None else None,
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    template = _field(reader, "tokenizer.chat_template")
    if template:
        tcfg["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=1))


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "forwardpass" / "gguf"


def gguf_model_dir(path: str | os.PathLike[str]) -> Path:
    """A model directory standing for the GGUF file ``path`` (made once per file version, then reused)."""
    path = Path(path).expanduser().resolve()
    st = path.stat()
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = _cache_root() / f"{path.stem}-{key}"
    if (out / MARKER).exists():
        return out
    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in ARCHS:
        raise ConfigError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHS)}", param="model"
        )
    check_tensor_types(reader)  # no model directory for a file we cannot load
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = _config(reader, arch)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    gen = {k: cfg[k] for k in ("eos_token_id", "bos_token_id") if k in cfg}
    (tmp / "generation_config.json").write_text(json.dumps(gen))
    _tokenizer_files(reader, tmp)
    (tmp / MARKER).write_text(json.dumps({"file": str(path), "architecture": arch}))
    tmp.replace(out) if not out.exists() else None
    return out


def is_gguf_dir(model_dir: str | os.PathLike[str]) -> bool:
    return (Path(model_dir) / MARKER).is_file()


def check_gguf_dir(model_dir: str | os.PathLike[str]) -> None:
    """Refuse a GGUF model directory whose file we cannot load (its tensor types, from the header: nothing is read
    or built), nothing for any other directory: what an engine does first, before it compiles a kernel for it."""
    if is_gguf_dir(model_dir):
        check_tensor_types(_reader(Path(json.loads((Path(model_dir) / MARKER).read_text())["file"])))


# ----- weights ------------------------------------------------------------------------------------
def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """GGML's interleaved rotary rows → HF's rotate-half rows (rows only; works on block-quantized rows)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class _Tensor:
    """One GGUF tensor: ``fmt`` is "f32" (F32/F16 read as fp32) or a block format with ``qs``/``d``."""

    def __init__(self, t):
        from gguf import GGMLQuantizationType as T

        n = int(t.shape[1]) if len(t.shape) > 1 else 1
        k = int(t.shape[0])
        data = np.asarray(t.data)
        self.k = k
        if t.tensor_type in (T.F32, T.F16):
            self.fmt = "f32"
            self.w = (
                torch.from_numpy(data.astype(np.float32).reshape(-1)).reshape(n, k)
                if len(t.shape) > 1
                else torch.from_numpy(data.astype(np.float32).reshape(-1))
            )
        elif t.tensor_type in (T.Q8_0, T.Q4_0):
            q4 = t.tensor_type == T.Q4_0
            self.fmt = "q4_0" if q4 else "q8_0"
            with warnings.catch_warnings():  # a read-only memory map: the slices below copy out of it
                warnings.simplefilter("ignore", UserWarning)
                blocks = torch.from_numpy(
                    np.ascontiguousarray(data).view(np.uint8).reshape(n, k // 32, 18 if q4 else 34)
                )
            self.d = blocks[..., :2].contiguous().view(torch.float16).reshape(n, k // 32)
            vals = blocks[..., 2:].reshape(n, -1).contiguous()
            self.qs = vals if q4 else vals.view(torch.int8)
        else:
            raise ConfigError(
                f"GGUF tensor {t.name} has type {t.tensor_type.name}; supported: {', '.join(SUPPORTED_TYPES)}",
                param="model",
            )

    def rows_permuted(self, n_head: int) -> _Tensor:
        if self.fmt == "f32":
            self.w = _unpermute(self.w, n_head)
        else:
            self.qs, self.d = _unpermute(self.qs, n_head), _unpermute(self.d, n_head)
        return self

    def float(self) -> torch.Tensor:
        if self.fmt == "f32":
            return self.w
        from forwardpass.quant.formats import dequantize

        return dequantize(self.qs, self.d, self.fmt, self.k)


def _set_weight(module: nn.Module, parts: list[_Tensor]) -> None:
    """Give linear layer ``module`` the rows of ``parts`` stacked: blocks through its weight method when they all
    share a block format, else fp32 values."""
    from forwardpass.quant.weight import QuantizedWeight

    fmts = {p.fmt for p in parts}
    if fmts == {"f32"} or len(fmts) > 1:
        w = torch.cat([p.float() for p in parts]) if len(parts) > 1 else parts[0].float()
        module.weight.data.copy_(w.reshape(module.weight.shape))
        return
    fmt = fmts.pop()
    qw = QuantizedWeight(torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]), fmt, parts[0].k)
    module.method.load_blocks(module, qw)  # held as stored (layers/weight_methods.py)


def load_gguf_model(
    model_dir: str | os.PathLike[str], dtype: torch.dtype = torch.float32, device: str = "cpu"
):
    """``(model, spec)`` for a directory made by :func:`gguf_model_dir`, weights read from its GGUF file."""
    from forwardpass.loader.config import load_model_config
    from forwardpass.loader.spec import ModelSpec
    from forwardpass.models.loading import build_model
    from forwardpass.quant.weight import QuantizedWeight

    if dtype != torch.float32 or not str(device).startswith("cpu"):
        raise ConfigError(
            "GGUF models run on CPU in float32 (their quantized weights use the CPU kernels)", param="dtype"
        )
    model_dir = Path(model_dir)
    marker = json.loads((model_dir / MARKER).read_text())
    reader = _reader(Path(marker["file"]))
    check_tensor_types(reader)  # again: a directory made before this check, or a file replaced since
    spec = ModelSpec.from_config(load_model_config(model_dir), name=Path(marker["file"]).name)
    tensors = {t.name: t for t in reader.tensors}

    def get(name: str) -> _Tensor:
        if name not in tensors:
            raise ConfigError(f"GGUF file lacks tensor {name}", param="model")
        return _Tensor(tensors[name])

    model = build_model(spec, dtype, device)
    llama = marker["architecture"] == "llama"
    with torch.no_grad():
        inner = model.model
        emb = get("token_embd.weight")
        if spec.tied and emb.fmt != "f32":  # the LM head's blocks as stored; lookups dequantize their rows
            embed = inner.embed_tokens
            embed.head_method.load_blocks(embed, QuantizedWeight(emb.qs, emb.d, emb.fmt, emb.k))
        else:
            inner.embed_tokens.weight.data.copy_(emb.float())
        if not spec.tied:
            _set_weight(model.lm_head, [get("output.weight")])
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
