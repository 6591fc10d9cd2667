"""Reading the small JSON files of model directories (configs, tokenizer and adapter settings)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from forwardpass.errors import ForwardpassError, ModelLoadError


def read_json_object(
    path: Path, *, error: type[ForwardpassError] = ModelLoadError, fix: str = "", **error_kwargs: Any
) -> dict[str, Any]:
    """``path`` parsed as a JSON object; otherwise ``error`` naming the file, the problem and ``fix``."""
    hint = f"; {fix}" if fix else ""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{path} is not valid JSON ({exc}){hint}", **error_kwargs) from exc
    if not isinstance(data, dict):
        raise error(f"{path} must hold a JSON object{hint}", **error_kwargs)
    return data
