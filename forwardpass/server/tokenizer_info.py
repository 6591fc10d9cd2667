"""``GET /tokenizer_info`` (vLLM's, behind ``--enable-tokenizer-info-endpoint``): the tokenizer's
configuration as ``tokenizer_config.json`` gives it, with the chat template the server renders and its context
window.

Off by default, as in vLLM: it publishes the chat template. Filesystem paths are never sent."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: keys of tokenizer_config.json that name files or directories on the server
_PATHS = ("name_or_path", "tokenizer_file", "vocab_file", "merges_file", "auto_map")


def tokenizer_info(model_dir: Path, chat_template: str | None, max_model_len: int) -> dict[str, Any]:
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    info = {k: v for k, v in config.items() if k not in _PATHS} if isinstance(config, dict) else {}
    info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    info["chat_template"] = chat_template
    info["model_max_length"] = max_model_len
    return info
