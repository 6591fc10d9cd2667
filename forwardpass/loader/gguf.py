"""GGUF files (llama.cpp's format) as models: ``LLM("model.gguf")``, ``--model model.gguf``.

Llama, Qwen2 and Qwen3 dense files with tensors of the types in ``gguf_checks.SUPPORTED_TYPES`` (F32, F16,
BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants Q2_K..Q6_K; docs/gguf.md), mixed freely. Reading one has
two halves:

* :func:`gguf_model_dir`: the file's metadata becomes a small model directory in the cache (config.json,
  tokenizer.json built from the GGUF vocabulary and merges, tokenizer_config.json with the chat template,
  generation_config.json, and ``gguf.json`` naming the file), so everything that reads a model directory
  (the spec, tokenizer, chat template, stop tokens, structured output) works unchanged;
* ``models/gguf_weights.py::load_gguf_model``: the weights, read from the memory-mapped file into the model
  built from that spec (model-side: it builds the model; this module reads the format only). Float tensors
  become fp32 parameters; quantized ones go to the quantized kernels (``forwardpass/quant``) with their codes
  and scales as they are, no requantization.

Before either, ``gguf_checks.py`` refuses a file it cannot load (unreadable, unknown architecture, a tensor
type we do not compute with, a tensor whose bytes do not match its shape) from its header alone.

Metadata keys and tensor names are llama.cpp's (the ``gguf`` package's constants). Llama's q/k rows are
stored permuted for GGML's interleaved rotary layout; we undo it as transformers' GGUF reader does.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from forwardpass.errors import ConfigError
from forwardpass.loader import gguf_checks
from forwardpass.loader.gguf_checks import ARCHS, SUPPORTED_TYPES, check_tensor_types  # noqa: F401 (re-exported)
from forwardpass.loader.gguf_checks import field as _field

MARKER = "gguf.json"
# tokenizer.ggml.pre → the split regex in front of the byte-level BPE (GPT-2's is ByteLevel's own), as
# llama.cpp's llama-vocab.cpp splits for each
PRE_TOKENIZER_REGEX = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
#: every digit its own piece, then GPT-2's regex (llama.cpp: "\p{N}" before GPT-2's; the Digits + ByteLevel
#: pre-tokenizer of these models' own tokenizer.json files)
DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
#: GPT-2's own regex (ByteLevel's)
GPT2_REGEX = ("gpt-2", "default", "mpt", "olmo", "jais")


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
    pre = _field(reader, "tokenizer.ggml.pre", "gpt-2")
    known = (*PRE_TOKENIZER_REGEX, *DIGITS_THEN_GPT2, *GPT2_REGEX)
    if pre not in known:
        raise ConfigError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(known)}",
                          param="model")
    if pre in DIGITS_THEN_GPT2:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )  # fmt: skip
    elif pre in PRE_TOKENIZER_REGEX:
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
    reader, arch = gguf_checks.check_file(path)  # no model directory for a file we cannot load
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        cfg = _config(reader, arch)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
        gen = {k: cfg[k] for k in ("eos_token_id", "bos_token_id") if k in cfg}
        (tmp / "generation_config.json").write_text(json.dumps(gen))
        _tokenizer_files(reader, tmp)
    except Exception as exc:  # noqa: BLE001 - whatever the metadata's lie raised becomes one clear error
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-made stays in the cache
        if isinstance(exc, ConfigError):
            raise
        # metadata of the wrong type or out of range (a head count of 0, a token id past the vocabulary)
        raise ConfigError(f"GGUF file {path} has invalid metadata: {type(exc).__name__}: {exc}",
                          param="model") from None
    (tmp / MARKER).write_text(json.dumps({"file": str(path), "architecture": arch}))
    tmp.replace(out) if not out.exists() else None
    return out


def is_gguf_dir(model_dir: str | os.PathLike[str]) -> bool:
    return (Path(model_dir) / MARKER).is_file()


def check_gguf_dir(model_dir: str | os.PathLike[str]) -> None:
    """Refuse a GGUF model directory whose file we cannot load (``gguf_checks.check_file``, from the header:
    nothing is read or built), nothing for any other directory: what an engine does first, before it compiles
    a kernel."""
    if is_gguf_dir(model_dir):
        gguf_checks.check_file(gguf_file(model_dir))


def gguf_file(model_dir: str | os.PathLike[str]) -> Path:
    """The GGUF file a directory made by :func:`gguf_model_dir` stands for."""
    return Path(json.loads((Path(model_dir) / MARKER).read_text())["file"])
