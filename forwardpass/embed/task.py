"""Which job a model directory serves: ``generate`` (a decoder, the paged engine) or
``embed`` (an encoder)."""

from __future__ import annotations

from pathlib import Path

from forwardpass.errors import ValidationError

TASKS = ("auto", "generate", "embed")


def resolve_task(model_dir: str | Path, task: str | None) -> str:
    """``auto`` (or None) picks from config.json's architecture; an explicit task must fit the model."""
    from forwardpass.loader.config import load_model_config
    from forwardpass.models.registry import is_embedding_architecture

    task = task or "auto"
    if task not in TASKS:
        raise ValidationError(f"task must be one of {list(TASKS)}, got {task!r}", param="task")
    arch = load_model_config(model_dir).architecture
    encoder = is_embedding_architecture(arch)
    if task == "auto":
        return "embed" if encoder else "generate"
    if task == "generate" and encoder:
        raise ValidationError(
            f"{arch} is an encoder: it embeds text and cannot generate; use task='embed' "
            "(forwardpass serve --task embed)",
            param="task",
        )
    if task == "embed" and not encoder:
        raise ValidationError(
            f"{arch or 'this model'} is a generative model; task='embed' needs an encoder "
            "model such as BertModel (sentence-transformers checkpoints)",
            param="task",
        )
    return task
