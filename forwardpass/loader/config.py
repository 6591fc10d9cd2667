"""config.json → ``ModelConfig``: the raw Hugging Face fields plus the derived ones every consumer needs.

The engine, the analyzer and the server all read a model through this one function, so a field that
HF leaves implicit (``head_dim``, ``num_key_value_heads``) is derived in exactly one place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from forwardpass.errors import MissingFileError, ModelNotFoundError
from forwardpass.loader.jsonfile import read_json_object


class ModelConfig(dict):
    """A config.json as a dict with attribute access (``cfg.hidden_size``) and derived defaults."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"config has no field {name!r}") from None

    @property
    def architecture(self) -> str:
        archs = self.get("architectures") or []
        return archs[0] if archs else ""


def _derive(cfg: ModelConfig) -> ModelConfig:
    if "hidden_size" in cfg and "num_attention_heads" in cfg:
        cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
        if cfg.get("head_dim") is None:
            cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg.setdefault("tie_word_embeddings", False)
    cfg.setdefault("rms_norm_eps", 1e-6)
    # transformers >= 5 writes rope settings as one `rope_parameters` dict; older versions wrote
    # `rope_theta` plus an optional `rope_scaling`. Normalize to the older pair, used everywhere here.
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict):
        cfg.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
        if rope.get("rope_type", "default") != "default" and not cfg.get("rope_scaling"):
            cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    cfg.setdefault("rope_theta", 10000.0)
    cfg.setdefault("rope_scaling", None)
    return cfg


def load_model_config(path: str | Path) -> ModelConfig:
    """Read ``path/config.json`` (or ``path`` itself if it is a JSON file) with clear errors."""
    path = Path(path)
    if not path.exists():
        raise ModelNotFoundError(f"model path {str(path)!r} does not exist; pass a directory written by save_pretrained")
    cfg_path = path if path.is_file() else path / "config.json"
    if not cfg_path.is_file():
        raise MissingFileError(
            f"{cfg_path} is missing: a model directory needs config.json (as written by save_pretrained)"
        )
    raw = read_json_object(cfg_path, fix="re-save the model with save_pretrained")
    # Some composite configs (e.g. multimodal) nest the language model under text_config.
    if "text_config" in raw and "hidden_size" not in raw:
        merged = dict(raw["text_config"])
        merged.setdefault("architectures", raw.get("architectures"))
        raw = merged
    return _derive(ModelConfig(raw))
