"""Embedded default models, shipped inside the package so the first command needs no download.

The LLM in ``llm/`` is a small Qwen3ForCausalLM trained from scratch on Jane Austen's novels by
``scripts/train_default_llm.py``; ``README.md`` beside this file says how, and how well it does.
"""

from __future__ import annotations

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent


def default_llm_path() -> Path:
    """The directory of the embedded default LLM (a normal Hugging Face model directory)."""
    return ASSETS_DIR / "llm"


def default_llm_draft_path() -> Path:
    """The draft model of the default LLM for speculative decoding (``method: draft_model``): a 1.1M-parameter
    Qwen3 distilled from it, same tokenizer (``scripts/train_draft_llm.py``)."""
    return ASSETS_DIR / "llm_draft"


def default_llm_heldout_text_path() -> Path:
    """The held-out evaluation text of the default LLM (never seen in training)."""
    return ASSETS_DIR / "data" / "austen_heldout.txt"
