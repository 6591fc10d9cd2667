"""A typed bounds check of a config.json's sizes, before anything is allocated.

``ModelSpec.from_config`` calls :func:`validate_config` first. Every size must be a JSON integer (not a
string, float or bool) within a sane range, so a hostile or broken config gives one clear
``ConfigError`` naming the key instead of a raw Python exception, a useless model, or a 34 GB
allocation. When the config was read from a model directory (``load_model_config``), the checkpoint's
tensor shapes (safetensors headers only, no data) are compared with the config too, so a config whose
sizes disagree with its weights fails before the model's parameters are allocated
(``WeightShapeError`` / ``MissingTensorError``, as the loader would raise later).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from forwardpass.errors import ConfigError, ForwardpassError, MissingTensorError, WeightShapeError

#: key -> (smallest, largest) allowed value. Generous: the largest public models fit well inside.
SIZE_LIMITS: dict[str, tuple[int, int]] = {
    "hidden_size": (1, 32768),
    "num_hidden_layers": (1, 1024),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (1, 4096),
    "intermediate_size": (0, 262144),
    "moe_intermediate_size": (1, 262144),
    "shared_expert_intermediate_size": (0, 262144),
    "vocab_size": (1, 1 << 20),
    "max_position_embeddings": (1, 1 << 27),
    "num_experts": (0, 4096),
    "num_local_experts": (0, 4096),
    "num_experts_per_tok": (0, 4096),
    "num_experts_per_token": (0, 4096),
    "decoder_sparse_step": (1, 1024),
    "max_window_layers": (0, 1024),
    "sliding_window": (1, 1 << 27),
    # Mamba2 / Nemotron-H mixers
    "num_heads": (1, 1 << 16),
    "mamba_num_heads": (1, 1 << 16),
    "mamba_head_dim": (1, 1 << 16),
    "state_size": (1, 1 << 16),
    "ssm_state_size": (1, 1 << 16),
    "n_groups": (1, 1 << 16),
    "conv_kernel": (1, 1024),
    "chunk_size": (1, 1 << 20),
    "type_vocab_size": (0, 1 << 16),  # BERT segment embeddings
    # Whisper (encoder–decoder speech recognition)
    "d_model": (1, 32768),
    "encoder_layers": (1, 1024),
    "decoder_layers": (1, 1024),
    "encoder_attention_heads": (1, 1024),
    "decoder_attention_heads": (1, 1024),
    "encoder_ffn_dim": (1, 262144),
    "decoder_ffn_dim": (1, 262144),
    "num_mel_bins": (1, 1024),
    "max_source_positions": (1, 1 << 16),
    "max_target_positions": (2, 1 << 20),
}
_LAYER = re.compile(r"\blayers\.(\d+)\.")
#: floats that must be finite and positive
POSITIVE_FLOATS = ("rms_norm_eps", "rope_theta", "layer_norm_eps")
#: parameters (sum of the big matrices) above which a config is refused before allocation
MAX_PARAMS = 2 * 10**12


def _int(cfg: Mapping[str, Any], key: str, where: str) -> int | None:
    value = cfg.get(key)
    if value is None:
        return None
    lo, hi = SIZE_LIMITS[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            f"{where}: {key} must be an integer in [{lo}, {hi}], got {type(value).__name__} {value!r:.40}",
            param=key
        )
    if not lo <= value <= hi:
        raise ConfigError(f"{where}: {key} must be an integer in [{lo}, {hi}], got {value}", param=key)
    return value


def validate_config(cfg: Mapping[str, Any], name: str = "") -> None:
    """Raise ``ConfigError`` naming the key if any size is missing-typed, out of range or inconsistent."""
    where = f"config {name}".strip() if name else "config.json"
    sizes = {key: _int(cfg, key, where) for key in SIZE_LIMITS}
    for key in POSITIVE_FLOATS:
        v = cfg.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or not 0 < v < float("inf")):
            raise ConfigError(f"{where}: {key} must be a positive finite number, got {v!r:.40}", param=key)
    hidden, heads = sizes["hidden_size"], sizes["num_attention_heads"]
    kv, head_dim = sizes["num_key_value_heads"], sizes["head_dim"]
    if hidden and heads and head_dim is None and hidden % heads:
        raise ConfigError(f"{where}: hidden_size={hidden} is not a multiple of num_attention_heads={heads} "
                          "(and no head_dim is given)", param="head_dim")
    if heads and kv and kv > heads:
        raise ConfigError(f"{where}: num_key_value_heads={kv} is larger than num_attention_heads={heads}",
                          param="num_key_value_heads")
    vocab, layers = sizes["vocab_size"], sizes["num_hidden_layers"]
    inter = max(sizes["intermediate_size"] or 0, sizes["moe_intermediate_size"] or 0)
    experts = max(sizes["num_experts"] or 0, sizes["num_local_experts"] or 0, 1)
    if hidden and layers and vocab and heads:
        hd = head_dim or hidden // heads
        per_layer = hidden * hd * (2 * heads + 2 * (kv or heads)) + 3 * hidden * inter * experts
        total = layers * per_layer + 2 * vocab * hidden
        if total > MAX_PARAMS:
            raise ConfigError(f"{where}: the sizes describe a model of ~{total:.2e} parameters; "
                              f"the limit is {MAX_PARAMS:.0e}", param="hidden_size")
    source = getattr(cfg, "source_dir", None)
    if source is not None:
        check_checkpoint_shapes(Path(source), cfg, where)


def check_checkpoint_shapes(model_dir: Path, cfg: Mapping[str, Any], where: str = "config.json") -> None:
    """Compare the checkpoint's embedding / lm_head / layer count with the config (headers only)."""
    from forwardpass.loader.weights import _read_header, find_weight_files

    try:
        files = find_weight_files(model_dir)
    except ForwardpassError:
        return  # no weights (yet): the loader reports that itself, with its own message
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        for tensor, meta in _read_header(file).items():
            if isinstance(meta, dict) and "shape" in meta:
                shapes[tensor] = tuple(meta["shape"])
    vocab, hidden = cfg.get("vocab_size"), cfg.get("hidden_size") or cfg.get("d_model")  # d_model: Whisper
    for tensor, shape in shapes.items():
        big = tensor.endswith(("embed_tokens.weight", "lm_head.weight", "wte.weight",
                               "word_embeddings.weight")) \
            and len(shape) == 2
        if big and shape != (vocab, hidden):
            raise WeightShapeError(
                f"{where} says vocab_size={vocab}, hidden_size={hidden} but the checkpoint's {tensor} has "
                f"shape {list(shape)}; the config does not belong to these weights", param="vocab_size")
    layer_ids = {int(m.group(1)) for t in shapes if (m := _LAYER.search(t))}
    layers = cfg.get("num_hidden_layers")
    if layer_ids and isinstance(layers, int) and max(layer_ids) + 1 < layers:
        raise MissingTensorError(f"{where} says num_hidden_layers={layers} but the checkpoint has no tensors "
                                 f"for layers.{max(layer_ids) + 1}. and above ({max(layer_ids) + 1} layers)",
                                 param="num_hidden_layers")
