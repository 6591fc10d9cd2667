"""How an encoder's hidden states become one vector: the sentence-transformers modules of a model directory.

A sentence-transformers directory lists its pipeline in ``modules.json``: a ``Transformer`` (the HF model
in the directory), a ``Pooling`` module (its ``config.json`` names the mode) and optionally
``Normalize`` (unit L2 length). vLLM reads the same two facts from the same files, and so do we:

* ``mean``: the average of the real tokens' hidden states (padding excluded);
* ``cls``: the first token's hidden state;
* ``last``: the last real token's hidden state (sentence-transformers calls it ``lasttoken``).

A directory without ``modules.json`` gets vLLM's default for BERT embedding models: ``cls`` pooling,
normalized. Modules that would change the vector further (``Dense`` projections, several pooling modes
concatenated, max pooling, prompts excluded from pooling) are refused with the module's name rather than
silently producing a different embedding than the model's authors intended.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from forwardpass.errors import ConfigError
from forwardpass.loader.jsonfile import read_json_object
from forwardpass.loader.paths import model_file

PoolingMode = Literal["mean", "cls", "last"]
POOLING_MODES: tuple[str, ...] = ("mean", "cls", "last")

# sentence-transformers' legacy boolean keys (all of 2.x-4.x wrote these) -> its mode names
_LEGACY_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_OURS = {"mean": "mean", "cls": "cls", "lasttoken": "last"}


@dataclass(frozen=True)
class PoolingConfig:
    mode: PoolingMode
    normalize: bool
    source: str  # where the choice came from (logged, and shown by ``LLM.embed``'s docs)


#: vLLM's default for a BERT embedding model without sentence-transformers files
DEFAULT_POOLING = PoolingConfig(
    mode="cls", normalize=True, source="default (no modules.json): cls, normalized"
)


def read_pooling_config(model_dir: str | Path) -> PoolingConfig:
    """The pooling of the model in ``model_dir`` (see the module docstring)."""
    model_dir = Path(model_dir)
    modules_file = model_file(model_dir, "modules.json")
    if not modules_file.is_file():
        return DEFAULT_POOLING
    modules = _read_modules(modules_file)
    pooling: PoolingMode | None = None
    normalize = False
    for entry in modules:
        kind = str(entry.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            if entry.get("path") not in ("", None, "."):
                raise ConfigError(
                    f"{modules_file}: the Transformer module lives in {entry.get('path')!r}; "
                    "pass that sub-directory as the model",
                    param="model",
                )
        elif kind == "Pooling":
            pooling = _pooling_mode(model_dir, str(entry.get("path") or ""))
        elif kind == "Normalize":
            normalize = True
        else:
            raise ConfigError(
                f"{modules_file}: the sentence-transformers module {entry.get('type')!r} is not "
                "supported (supported: Transformer, Pooling, Normalize)",
                param="model",
            )
    if pooling is None:
        raise ConfigError(f"{modules_file} lists no Pooling module; an embedding needs one", param="model")
    return PoolingConfig(
        mode=pooling,
        normalize=normalize,
        source=f"modules.json: {pooling}{', normalized' if normalize else ''}",
    )


def _read_modules(path: Path) -> list[dict[str, Any]]:
    import json

    from forwardpass.loader.jsonfile import MAX_JSON_BYTES

    if path.stat().st_size > MAX_JSON_BYTES:
        raise ConfigError(
            f"{path} is larger than {MAX_JSON_BYTES} bytes; it cannot be a module list", param="model"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc})", param="model") from None
    if not isinstance(data, list) or not all(
        isinstance(m, dict) and isinstance(m.get("idx", 0), int) for m in data
    ):
        raise ConfigError(f"{path} must be a list of module objects with integer 'idx'", param="model")
    return sorted(data, key=lambda m: m.get("idx", 0))


def _pooling_mode(model_dir: Path, sub: str) -> PoolingMode:
    file = model_file(model_dir, Path(sub) / "config.json")
    cfg = (
        read_json_object(file, error=ConfigError, fix="re-save the model with sentence-transformers")
        if file.is_file()
        else {}
    )
    mode = cfg.get("pooling_mode")  # sentence-transformers >= 5 writes one key, older versions booleans
    if mode is None:
        modes = [name for key, name in _LEGACY_KEYS.items() if cfg.get(key)]
        mode = modes or ["mean"]  # sentence-transformers' own default
    modes_list = [mode] if isinstance(mode, str) else list(mode)
    if len(modes_list) != 1:
        raise ConfigError(
            f"{file}: several pooling modes {modes_list} (concatenated) are not supported; "
            f"one of {sorted(_OURS)} is",
            param="pooling_mode",
        )
    if cfg.get("include_prompt") is False:
        raise ConfigError(
            f"{file}: include_prompt=false (prompt tokens excluded from pooling) is not supported",
            param="include_prompt",
        )
    found = str(modes_list[0])
    if found not in _OURS:
        raise ConfigError(
            f"{file}: pooling mode {found!r} is not supported (supported: {sorted(_OURS)})",
            param="pooling_mode",
        )
    return _OURS[found]  # type: ignore[return-value]


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """``hidden [B, N, H]``, ``mask [B, N]`` (True = real token, right-padded) -> ``[B, H]``, in fp32."""
    h = hidden.float()
    if mode == "cls":
        return h[:, 0]
    lengths = mask.sum(dim=1)
    if mode == "last":
        last = (lengths - 1).clamp_min(0)
        return h[torch.arange(h.shape[0], device=h.device), last]
    if mode == "mean":
        m = mask.unsqueeze(-1).to(h.dtype)
        return (h * m).sum(dim=1) / lengths.clamp_min(1).unsqueeze(-1).to(h.dtype)
    raise ConfigError(f"unknown pooling mode {mode!r}; use one of {POOLING_MODES}", param="pooling")


def normalize(x: torch.Tensor) -> torch.Tensor:
    """Unit L2 length per row (sentence-transformers' ``Normalize``: ``F.normalize``, eps 1e-12)."""
    return torch.nn.functional.normalize(x, p=2, dim=-1)
