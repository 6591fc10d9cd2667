"""config.json → ``ModelConfig``: the raw Hugging Face fields, read with clear errors.

Nothing but :class:`forwardpass.models.model_spec.ModelSpec` should read these keys: it resolves what HF
leaves implicit (``head_dim``, ``num_key_value_heads``, sliding-window layers, MoE layout, rope) once.
Use :func:`forwardpass.models.model_spec.load_model_spec` to read a model directory.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from forwardpass.errors import ConfigError, MissingFileError, ModelNotFoundError
from forwardpass.loader.jsonfile import read_json_object
from forwardpass.loader.paths import model_file


class ModelConfig(dict):
    """A config.json as a dict with attribute access (``cfg.hidden_size``), exactly as written."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"config has no field {name!r}") from None

    @property
    def architecture(self) -> str:
        archs = self.get("architectures") or []
        return archs[0] if archs else ""


def load_model_config(path: str | Path) -> ModelConfig:
    """Read ``path/config.json`` (or ``path`` itself if it is a JSON file) with clear errors.

    Raw keys only (a nested ``text_config`` is un-nested); build a ``ModelSpec`` from it to use it."""
    path = Path(path)
    if not path.exists():
        raise ModelNotFoundError(f"model path {str(path)!r} does not exist; pass a directory written by "
                                 "save_pretrained")
    cfg_path = path if path.is_file() else model_file(path, "config.json")
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
    cfg = ModelConfig(raw)
    cfg.source_dir = cfg_path.parent  # lets validate_config compare the checkpoint's shapes before allocation
    return cfg


def eos_token_ids(cfg: Mapping[str, Any]) -> tuple[int, ...]:
    """config.json's ``eos_token_id`` (an int, a list of ints, or absent) as a tuple.

    ``ModelSpec`` reads it, and ``generation_config`` too, also from config.json files that are not
    complete decoder configs (and so have no spec)."""
    value = cfg.get("eos_token_id")
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"eos_token_id in config.json must be an int or a list of ints, got {value!r}",
                          param="eos_token_id")
    return tuple(values)
