"""generation_config.json -> the model author's default sampling settings and stop tokens.

A request's own SamplingParams override these; they only fill what the request leaves unset.
``do_sample`` is deliberately not read (vLLM does the same): a model that ships a temperature wants
it used, and greedy is requested per call with temperature=0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from forwardpass.errors import ConfigError, ModelLoadError
from forwardpass.loader.config import eos_token_ids, load_model_config
from forwardpass.loader.jsonfile import read_json_object
from forwardpass.loader.paths import model_file

GENERATION_CONFIG_FILE = "generation_config.json"


class StopTokens(Protocol):
    """What is read of a model's spec (``ModelSpec``, which lives above this format reader)."""

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...  # read-only: the spec is frozen

# field name -> accepted JSON type(s); ints are accepted where floats are expected (temperature: 1).
_FIELDS: dict[str, type | tuple[type, ...]] = {
    "temperature": (int, float),
    "top_p": (int, float),
    "top_k": int,
    "min_p": (int, float),
    "repetition_penalty": (int, float),
    "max_new_tokens": int,
}


@dataclass
class GenerationDefaults:
    eos_token_ids: list[int] = field(default_factory=list)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None


def _eos_list(value: object, where: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ModelLoadError(f"{where}: eos_token_id must be an int or a list of ints, got {value!r}")
    return list(values)


def load_generation_config(model_dir: str | Path, spec: StopTokens | None = None) -> GenerationDefaults:
    """Read ``generation_config.json`` (optional) and merge its stop tokens with the model's
    (``spec.eos_token_ids``; without a spec, those of ``model_dir/config.json`` if there is one)."""
    model_dir = Path(model_dir)
    path = model_file(model_dir, GENERATION_CONFIG_FILE)
    raw = read_json_object(path, fix="fix or delete generation_config.json") if path.is_file() else {}

    eos = _eos_list(raw.get("eos_token_id"), str(path))
    if spec is not None:
        eos += spec.eos_token_ids
    elif (model_dir / "config.json").is_file():
        try:  # the one derivation ModelSpec uses, also for a config.json that is no full decoder config
            eos += eos_token_ids(load_model_config(model_dir))
        except ConfigError as exc:
            raise ModelLoadError(f"{model_dir}: {exc.message}") from exc
    defaults = GenerationDefaults(eos_token_ids=list(dict.fromkeys(eos)))  # dedupe, keep order

    for name, kind in _FIELDS.items():
        value = raw.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ModelLoadError(
                f"{path}: {name} must be a number, got {value!r}; fix generation_config.json"
            )
        setattr(defaults, name, float(value) if kind != int else value)
    return defaults
