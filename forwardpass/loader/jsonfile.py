"""Reading the small JSON files of model directories (configs, tokenizer and adapter settings)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from forwardpass.errors import ForwardpassError, ModelLoadError

MAX_JSON_BYTES = 64 << 20  # tokenizer_config.json with a large vocabulary stays well below this


def read_json_object(
    path: Path, *, error: type[ForwardpassError] = ModelLoadError, fix: str = "", **error_kwargs: Any
) -> dict[str, Any]:
    """``path`` parsed as a JSON object; otherwise ``error`` naming the file, the problem and ``fix``."""
    hint = f"; {fix}" if fix else ""
    size = Path(path).stat().st_size
    if size > MAX_JSON_BYTES:
        raise error(f"{path} is {size} bytes; JSON files of a model directory are at most "
                    f"{MAX_JSON_BYTES}{hint}", **error_kwargs)
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{path} is not valid JSON ({exc}){hint}", **error_kwargs) from exc
    except RecursionError as exc:
        raise error(f"{path} is nested too deeply to be a configuration file{hint}", **error_kwargs) from exc
    if not isinstance(data, dict):
        raise error(f"{path} must hold a JSON object{hint}", **error_kwargs)
    return data
