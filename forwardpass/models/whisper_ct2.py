"""Whisper from a CTranslate2 ``model.bin`` (faster-whisper's directories): its config and its weights.

CTranslate2's ``WhisperSpec`` names (``ct2-transformers-converter`` writes them from transformers' model),
with ``E`` = ``encoder/layer_N``, ``D`` = ``decoder/layer_N`` and ``X`` = either:

==========================================  ===============================================================
``encoder/conv{1,2}/{weight,bias}``         ``model.encoder.conv{1,2}``
``encoder/position_encodings/encodings``    ``model.encoder.embed_positions.weight``
``E/self_attention/linear_0``               q, k, v projections fused: ``[3d, d]``, rows q | k | v
``X/self_attention/linear_1``               ``self_attn.out_proj``
``X/self_attention/layer_norm``             ``self_attn_layer_norm`` (``gamma`` / ``beta``)
``X/ffn/{layer_norm,linear_0,linear_1}``    ``final_layer_norm``, ``fc1``, ``fc2``
``decoder/embeddings/weight``               ``model.decoder.embed_tokens`` (``decoder/projection`` is an alias
                                            of it: the LM head is tied)
``D/attention/linear_0``                    cross-attention ``q_proj``
``D/attention/linear_1``                    cross-attention k, v fused: ``[2d, d]``, rows k | v
``D/attention/linear_2``                    cross-attention ``out_proj``
``D/attention/layer_norm``                  ``encoder_attn_layer_norm``
==========================================  ===============================================================

The fused K rows carry a bias that transformers' model does not have (the converter fills zeros). It is
dropped: adding ``b`` to every key adds ``q·b`` to every score of a query's row, which softmax cancels.
Float16 and bfloat16 tensors become float32 in memory; int8 / int16 tensors (``--quantization int8``) are
dequantized with their ``weight_scale`` (``w = q / scale``, CTranslate2's convention), so the model loads
float32 values either way; an ``int8`` / ``int4`` plan then quantizes the projections and the tied LM head to
its own blocks once after loading (``models/prepare.py::process_weights_after_loading``), as for any
checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from forwardpass.errors import ConfigError, MissingFileError
from forwardpass.loader.ctranslate2 import (
    MARKER,
    MODEL_FILE,
    Header,
    read_header,
    read_tensor,
    scalar,
    source_dir,
)
from forwardpass.loader.jsonfile import read_json_object
from forwardpass.loader.paths import model_file

GELU = 3  # CTranslate2's Activation enum: RELU, GELUTanh, SWISH, GELU, ...
_REQUIRED = (
    "encoder/conv1/weight", "encoder/conv2/weight", "encoder/position_encodings/encodings",
    "encoder/layer_norm/gamma", "decoder/embeddings/weight", "decoder/position_encodings/encodings",
    "decoder/layer_norm/gamma", "encoder/layer_0/self_attention/linear_0/weight",
    "decoder/layer_0/self_attention/linear_0/weight", "decoder/layer_0/attention/linear_1/weight",
    "encoder/layer_0/ffn/linear_0/weight", "decoder/layer_0/ffn/linear_0/weight",
)  # fmt: skip


def _layers(header: Header, prefix: str) -> int:
    found = {int(m.group(1)) for n in header.variables if (m := re.match(rf"{prefix}/layer_(\d+)/", n))}
    if found != set(range(len(found))):
        raise ConfigError(
            f"{header.path}: {prefix} layers {sorted(found)} are not numbered 0..N-1", param="model"
        )
    return len(found)


def check_variables(header: Header, mm: np.ndarray) -> None:
    """Refuse a WhisperSpec file whose variables our Whisper cannot compute (before any model is built)."""
    missing = [n for n in _REQUIRED if header.get(n) is None]
    if missing:
        raise ConfigError(
            f"{header.path} lacks {', '.join(missing)}: not a complete Whisper model", param="model"
        )
    odd = [n for n in header.variables if n.endswith(("_zero", "queries_scale")) or "relative" in n]
    if odd:
        raise ConfigError(
            f"{header.path}: variable {odd[0]} (zero points, query scaling or relative positions) is "
            "not part of the Whisper forwardpass computes",
            param="model",
        )
    for name, want in (
        ("decoder/activation", GELU),
        ("decoder/pre_norm", 1),
        ("decoder/scale_embeddings", 0),
        ("decoder/alibi", 0),
    ):
        got = scalar(header, mm, name)
        if got is not None and got != want:
            raise ConfigError(f"{header.path}: {name} is {got}, Whisper's is {want}", param="model")


def whisper_configs(header: Header, ct2_config: dict[str, Any], tokenizer_json: Path) -> tuple[dict, dict]:
    """``(config.json, generation_config.json)`` of transformers' Whisper for the model in ``header``; a
    variable of the wrong rank or size (a damaged or hostile file) is one ``ConfigError``."""
    try:
        return _whisper_configs(header, ct2_config, tokenizer_json)
    except (ValueError, IndexError, TypeError, KeyError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{header.path}: its variables' shapes or values are not a Whisper model's "
                          f"({type(exc).__name__}: {exc})", param="model") from None


def _whisper_configs(header: Header, ct2_config: dict[str, Any], tokenizer_json: Path) -> tuple[dict, dict]:
    from tokenizers import Tokenizer

    mm = np.memmap(header.path, dtype=np.uint8, mode="r")
    check_variables(header, mm)
    shape = {n: header.get(n).shape for n in _REQUIRED}  # type: ignore[union-attr]
    vocab, d = shape["decoder/embeddings/weight"]
    tok = Tokenizer.from_file(str(tokenizer_json))

    def token(text: str) -> int:
        tid = tok.token_to_id(text)
        if tid is None:
            raise ConfigError(f"{tokenizer_json} has no {text} token: not a Whisper tokenizer", param="model")
        return int(tid)

    eot, sot = token("<|endoftext|>"), token("<|startoftranscript|>")
    heads = {side: scalar(header, mm, f"{side}/num_heads") for side in ("encoder", "decoder")}
    if None in heads.values():
        raise ConfigError(f"{header.path} lacks encoder/num_heads or decoder/num_heads", param="model")
    config = {
        "architectures": ["WhisperForConditionalGeneration"],
        "model_type": "whisper",
        "activation_function": "gelu",
        "d_model": d,
        "vocab_size": vocab,
        "num_mel_bins": shape["encoder/conv1/weight"][1],
        "encoder_layers": _layers(header, "encoder"),
        "decoder_layers": _layers(header, "decoder"),
        "encoder_attention_heads": heads["encoder"],
        "decoder_attention_heads": heads["decoder"],
        "encoder_ffn_dim": shape["encoder/layer_0/ffn/linear_0/weight"][0],
        "decoder_ffn_dim": shape["decoder/layer_0/ffn/linear_0/weight"][0],
        "max_source_positions": shape["encoder/position_encodings/encodings"][0],
        "max_target_positions": shape["decoder/position_encodings/encodings"][0],
        "decoder_start_token_id": sot,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "pad_token_id": eot,
        "scale_embedding": False,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }
    lang_ids = [int(i) for i in ct2_config.get("lang_ids") or []]
    generation = {
        "decoder_start_token_id": sot,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "pad_token_id": eot,
        "suppress_tokens": [int(i) for i in ct2_config.get("suppress_ids") or []],
        "begin_suppress_tokens": [int(i) for i in ct2_config.get("suppress_ids_begin") or []],
        "alignment_heads": [[int(a), int(b)] for a, b in ct2_config.get("alignment_heads") or []],
        "lang_to_id": {tok.id_to_token(i): i for i in lang_ids if tok.id_to_token(i)},
        "is_multilingual": vocab >= 51865,  # transformers' rule: English-only vocabularies have 51864 tokens
        "no_timestamps_token_id": token("<|notimestamps|>"),
        "max_initial_timestamp_index": 50,
    }
    return config, generation


# ----- weights
# --------------------------------------------------------------------------------------------------
def _value(header: Header, mm: np.ndarray, name: str) -> torch.Tensor:
    """Variable ``name`` as float32, dequantized when it has a ``_scale`` companion (int8 / int16 files)."""
    values = read_tensor(header, mm, name)
    if header.get(name + "_scale") is not None:
        scale = read_tensor(header, mm, name + "_scale").astype(np.float32)
        values = values.astype(np.float32) / scale.reshape(scale.shape + (1,) * (values.ndim - scale.ndim))
    elif values.dtype.kind != "f":
        var = header.get(name)
        kind = var.dtype if var else "?"
        raise ConfigError(f"{header.path}: {name} is {kind} without a scale", param="model")
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


class _Reader:
    def __init__(self, header: Header):
        self.header = header
        self.mm = np.memmap(header.path, dtype=np.uint8, mode="r")

    def __call__(self, name: str) -> torch.Tensor:
        return _value(self.header, self.mm, name)

    def copy(self, target: torch.Tensor, name: str, rows: slice | None = None) -> None:
        value = self(name)
        value = value if rows is None else value[rows]
        if tuple(value.shape) != tuple(target.shape):
            raise ConfigError(
                f"{self.header.path}: {name}{'' if rows is None else f'[{rows.start}:{rows.stop}]'} "
                f"has shape {list(value.shape)}, the model expects {list(target.shape)}",
                param="model",
            )
        target.copy_(value)

    def linear(self, module: nn.Module, name: str, rows: slice | None = None) -> None:
        self.copy(module.weight, f"{name}/weight", rows)
        if getattr(module, "bias", None) is not None:
            self.copy(module.bias, f"{name}/bias", rows)

    def norm(self, module: nn.Module, name: str) -> None:
        self.copy(module.weight, f"{name}/gamma")
        self.copy(module.bias, f"{name}/beta")


def _split(d: int, n: int) -> list[slice]:
    return [slice(i * d, (i + 1) * d) for i in range(n)]


def load_weights(model: nn.Module, header: Header) -> None:
    """Copy every variable of ``header``'s file into ``model`` (a ``WhisperForConditionalGeneration``)."""
    r = _Reader(header)
    enc, dec = model.model.encoder, model.model.decoder
    d = model.spec.hidden
    for conv in ("conv1", "conv2"):
        r.linear(getattr(enc, conv), f"encoder/{conv}")
    r.copy(enc.embed_positions.weight, "encoder/position_encodings/encodings")
    r.norm(enc.layer_norm, "encoder/layer_norm")
    for side, layers in (("encoder", enc.layers), ("decoder", dec.layers)):
        for i, layer in enumerate(layers):
            p = f"{side}/layer_{i}"
            a = layer.self_attn
            q, k, v = _split(d, 3)
            r.linear(a.q_proj, f"{p}/self_attention/linear_0", q)
            r.copy(a.k_proj.weight, f"{p}/self_attention/linear_0/weight", k)  # k's bias: see the module doc
            r.linear(a.v_proj, f"{p}/self_attention/linear_0", v)
            r.linear(a.out_proj, f"{p}/self_attention/linear_1")
            r.norm(layer.self_attn_layer_norm, f"{p}/self_attention/layer_norm")
            r.linear(layer.fc1, f"{p}/ffn/linear_0")
            r.linear(layer.fc2, f"{p}/ffn/linear_1")
            r.norm(layer.final_layer_norm, f"{p}/ffn/layer_norm")
            if side == "decoder":
                c = layer.encoder_attn
                k, v = _split(d, 2)
                r.linear(c.q_proj, f"{p}/attention/linear_0")
                r.copy(c.k_proj.weight, f"{p}/attention/linear_1/weight", k)
                r.linear(c.v_proj, f"{p}/attention/linear_1", v)
                r.linear(c.out_proj, f"{p}/attention/linear_2")
                r.norm(layer.encoder_attn_layer_norm, f"{p}/attention/layer_norm")
    r.copy(dec.embed_tokens.weight, "decoder/embeddings/weight")
    r.copy(dec.embed_positions.weight, "decoder/position_encodings/encodings")
    r.norm(dec.layer_norm, "decoder/layer_norm")
    head = header.aliases.get("decoder/projection/weight", "decoder/projection/weight")
    if head != "decoder/embeddings/weight" and header.get(head) is not None:
        if not torch.equal(r(head), dec.embed_tokens.weight):
            raise ConfigError(
                f"{header.path}: the output projection is not the token embedding; forwardpass's "
                "Whisper ties them, as every released Whisper does",
                param="model",
            )
    if header.get("decoder/projection/bias") is not None and bool(r("decoder/projection/bias").any()):
        raise ConfigError(
            f"{header.path}: the output projection has a bias; Whisper's has none", param="model"
        )


def load_ctranslate2_whisper(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """``(model, spec)`` for a directory made by :func:`ctranslate2_model_dir`."""
    from forwardpass.loader.config import load_model_config
    from forwardpass.models.loading import build_model
    from forwardpass.models.model_spec import ModelSpec

    src = source_dir(model_dir)
    header = read_header(src / "model.bin")  # again: the file may have changed since the directory was made
    check_variables(header, np.memmap(header.path, dtype=np.uint8, mode="r"))
    spec = ModelSpec.from_config(load_model_config(model_dir), name=src.name)
    model = build_model(spec, dtype, device)
    with torch.no_grad():
        load_weights(model, header)
    return model, spec


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "forwardpass" / "ctranslate2"


def ctranslate2_model_dir(path: str | os.PathLike[str]) -> Path:
    """A model directory standing for the CTranslate2 directory ``path`` (made once per version of
    its files)."""
    src = Path(path).expanduser().resolve()
    files = [src / MODEL_FILE, src / "config.json", src / "tokenizer.json"]
    stamp = "|".join(f"{f}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files if f.exists())
    out = _cache_root() / f"{src.name}-{hashlib.sha256(stamp.encode()).hexdigest()[:16]}"
    if (out / MARKER).exists():
        return out
    header = read_header(model_file(src, MODEL_FILE))  # refuses another spec, a truncated file, a bad dtype
    ct2_config = read_json_object(model_file(src, "config.json"), fix="convert the model again")
    tokenizer = model_file(src, "tokenizer.json")
    if not tokenizer.is_file():
        raise MissingFileError(
            f"{tokenizer} is missing: forwardpass reads a CTranslate2 Whisper model's vocabulary "
            "from tokenizer.json (faster-whisper directories have one)"
        )
    config, generation = whisper_configs(header, ct2_config, tokenizer)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=1))
    shutil.copyfile(tokenizer, tmp / "tokenizer.json")
    (tmp / MARKER).write_text(
        json.dumps({"source": str(src), "spec": header.spec, "revision": header.revision})
    )
    if out.exists():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.replace(out)
    return out
