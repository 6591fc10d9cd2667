"""``LLM.embed``: prompts in vLLM's forms to ``EmbeddingRequestOutput`` objects, in the prompts' order."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from forwardpass.embed.inputs import check_ids, encode_text, resolve_truncation
from forwardpass.embed.outputs import EmbeddingOutput, EmbeddingRequestOutput
from forwardpass.embed.runner import EmbeddingRunner
from forwardpass.errors import ConfigError, ValidationError

#: LLM(...) options that mean something to an encoder; the paged engine's (KV cache, LoRA, ...) do not
EMBED_OPTIONS = ("device", "max_model_len", "max_num_batched_tokens", "attention_backend")


def build_runner(model: str | Path, dtype: str, options: dict[str, Any]) -> EmbeddingRunner:
    unknown = sorted(set(options) - set(EMBED_OPTIONS))
    if unknown:
        raise ConfigError(
            f"option(s) {unknown} do not apply to task='embed' (an encoder has no KV cache or "
            f"sampling); embedding options: {list(EMBED_OPTIONS)}",
            param=unknown[0],
        )
    return EmbeddingRunner(model, dtype=dtype, **options)


def embed_prompts(
    runner: EmbeddingRunner,
    prompts: Any,
    *,
    truncate_prompt_tokens: int | None = None,
    use_tqdm: bool = True,
    ids: itertools.count | None = None,
) -> list[EmbeddingRequestOutput]:
    """A prompt is a string, a list of token ids, or ``{"prompt": str}`` / ``{"prompt_token_ids": [...]}``."""
    items = _as_list(prompts)
    limit = resolve_truncation(truncate_prompt_tokens, runner.limits)
    token_ids = []
    for i, p in enumerate(items):
        param = f"prompts[{i}]"
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                p = list(p["prompt_token_ids"])
            elif "prompt" in p:
                p = p["prompt"]
            else:
                raise ValidationError("a prompt dict needs 'prompt' or 'prompt_token_ids'", param=param)
        if isinstance(p, str):
            token_ids.append(encode_text(runner.tokenizer, p, runner.limits, limit, param))
        elif isinstance(p, (list, tuple)):
            token_ids.append(check_ids(list(p), runner.limits, limit, param))
        else:
            raise ValidationError(
                f"a prompt must be a string or a list of token ids, got {type(p).__name__}", param=param
            )
    counter = ids or itertools.count()
    vectors: list[list[float]] = []
    chunk = 256  # inputs per progress-bar update; each chunk is still batched by the token budget
    with tqdm(
        total=len(token_ids), desc="embedding", unit="input", disable=not use_tqdm or len(token_ids) < 2
    ) as bar:
        for start in range(0, len(token_ids), chunk):
            part = token_ids[start : start + chunk]
            vectors.extend(runner.embed_ids(part))
            bar.update(len(part))
    return [
        EmbeddingRequestOutput(
            request_id=str(next(counter)), outputs=EmbeddingOutput(vec), prompt_token_ids=t
        )
        for vec, t in zip(vectors, token_ids)
    ]


def _as_list(prompts: Any) -> Sequence[Any]:
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValidationError(
            "no prompts given: pass a string, a list of strings or lists of token ids", param="prompts"
        )
    return list(prompts)
