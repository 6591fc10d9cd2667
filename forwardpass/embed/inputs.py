"""Embedding inputs to token ids: tokenization, the length limit and explicit truncation.

``truncate_prompt_tokens`` (vLLM's name) is the only way an input gets shorter: ``k`` keeps at most ``k``
tokens, ``-1`` the model's maximum (``max_model_len``). Text is cut the way the model's tokenizer and
sentence-transformers cut it: the text's tokens are shortened from the right and the special tokens
([CLS] ... [SEP]) are kept, so the result equals sentence-transformers' for the same limit. Token-id
inputs are the caller's exact ids: the first ``k`` are kept. Without the option an input longer than
``max_model_len`` is an error that says how to truncate: an embedding of silently cut text is a wrong
answer that looks right.
"""

from __future__ import annotations

from dataclasses import dataclass

from forwardpass.errors import ContextLengthError, ValidationError
from forwardpass.loader.tokenizer import Tokenizer

#: tokenizer calls on text longer than this release the GIL (``encode_batch``), so a long text does not
#: stall the server's event loop thread while another thread tokenizes it
_LONG_TEXT = 16384


@dataclass(frozen=True)
class InputLimits:
    max_model_len: (
        int  # the most tokens one input may have (positions, sentence-transformers' max_seq_length)
    )
    vocab_size: int
    lowercase: bool = False  # sentence_bert_config.json do_lower_case: the text is lower-cased first


def resolve_truncation(truncate_prompt_tokens: int | None, limits: InputLimits) -> int | None:
    """The token limit an input is cut to (None: no truncation); -1 means ``max_model_len``."""
    k = truncate_prompt_tokens
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, int) or not (k == -1 or 1 <= k <= limits.max_model_len):
        raise ValidationError(
            f"truncate_prompt_tokens must be -1 (the model's maximum) or an integer in "
            f"[1, {limits.max_model_len}] (max_model_len), got {k!r}",
            param="truncate_prompt_tokens",
        )
    return limits.max_model_len if k == -1 else k


def encode_text(
    tokenizer: Tokenizer, text: str, limits: InputLimits, limit: int | None, param: str = "input"
) -> list[int]:
    """``text`` as the model's token ids, special tokens included, cut to ``limit`` tokens if given."""
    if not isinstance(text, str):
        raise ValidationError(f"{param} must be a string, got {type(text).__name__}", param=param)
    backend = tokenizer.backend
    if limits.lowercase:
        text = text.lower()
    if len(text) > _LONG_TEXT:
        enc = backend.encode_batch([text], add_special_tokens=False)[0]
    else:
        enc = backend.encode(text, add_special_tokens=False)
    special = backend.num_special_tokens_to_add(False)
    if limit is not None and len(enc.ids) + special > limit:
        if limit < special:
            raise ValidationError(
                f"truncate_prompt_tokens={limit} leaves no room for the model's {special} special tokens",
                param="truncate_prompt_tokens",
            )
        enc.truncate(limit - special)  # right side, as HF tokenizers and sentence-transformers truncate
    ids = backend.post_process(enc).ids
    return check_ids(ids, limits, None, param)


def check_ids(ids: list[int], limits: InputLimits, limit: int | None, param: str = "input") -> list[int]:
    """Token ids in range, not empty, within ``max_model_len`` (after keeping the first ``limit``)."""
    if not ids:
        raise ValidationError(f"{param} is empty; an embedding needs at least one token", param=param)
    if limit is not None:
        ids = ids[:limit]
    bad = next(
        (t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < limits.vocab_size),
        None,
    )
    if bad is not None:
        raise ValidationError(
            f"{param}: token id {bad!r} is not in the model's vocabulary [0, {limits.vocab_size})",
            param=param,
        )
    if len(ids) > limits.max_model_len:
        raise ContextLengthError(
            f"{param} has {len(ids)} tokens, more than this model's maximum of {limits.max_model_len} "
            f"(max_model_len); shorten it, or pass truncate_prompt_tokens=-1 to keep the first "
            f"{limits.max_model_len} tokens",
            param=param,
        )
    return list(ids)
