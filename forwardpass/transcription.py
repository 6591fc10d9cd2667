"""What the ``transcribe`` command and ``POST /v1/audio/transcriptions`` share: Whisper's decoder prompt,
the default speech model, and the response shapes.

Whisper's decoder starts from special tokens that say what to do: ``<|startoftranscript|>``, the
language (``<|en|>``), the task (``<|transcribe|>`` or ``<|translate|>``) and ``<|notimestamps|>``
(plain text, no timestamp tokens). They are looked up in the model's own tokenizer, so a checkpoint
whose tokenizer lacks one gets an error that names it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from forwardpass.errors import ValidationError
from forwardpass.loader.tokenizer import Tokenizer

RESPONSE_FORMATS = ("json", "text", "verbose_json")


def default_speech_model_path() -> Path:
    """The embedded speech model (``forwardpass/assets/speech``: a tiny Whisper trained here)."""
    return Path(__file__).resolve().parent / "assets" / "speech"


def transcription_prompt(
    tokenizer: Tokenizer | None, language: str | None = "en", task: str = "transcribe"
) -> list[int]:
    """Whisper's decoder prompt ``<|startoftranscript|><|LANG|><|TASK|><|notimestamps|>`` as token ids."""
    if tokenizer is None:
        raise ValidationError(
            "this speech model has no tokenizer.json to build the decoder prompt", param="model"
        )
    if task not in ("transcribe", "translate"):
        raise ValidationError(f"task must be 'transcribe' or 'translate', got {task!r}", param="task")
    lang = (language or "en").strip().lower()
    tokens = ["<|startoftranscript|>", f"<|{lang}|>", f"<|{task}|>", "<|notimestamps|>"]
    ids = [tokenizer.token_to_id(t) for t in tokens]
    if ids[1] is None:
        raise ValidationError(
            f"language {language!r} is not one this model's tokenizer knows (no <|{lang}|> token)",
            param="language",
        )
    missing = [t for t, i in zip(tokens, ids, strict=True) if i is None]
    if missing:
        raise ValidationError(
            f"this model's tokenizer has no {missing[0]} token: is it a Whisper model?", param="model"
        )
    return [int(i) for i in ids if i is not None]


def transcription_body(
    text: str, response_format: str, *, language: str, duration: float, window: float, num_tokens: int
) -> dict[str, Any] | str:
    """OpenAI's response for ``response_format``: ``{"text"}``, the bare text, or the verbose form (one
    segment: the part of the audio the encoder heard, at most its ``window`` seconds)."""
    text = text.strip()
    if response_format == "text":
        return text
    if response_format == "verbose_json":
        return {
            "task": "transcribe",
            "language": language,
            "duration": round(duration, 3),
            "text": text,
            "segments": [{"id": 0, "start": 0.0, "end": round(min(duration, window), 3), "text": text}],
            "usage": {"type": "tokens", "output_tokens": num_tokens},
        }
    return {"text": text, "usage": {"type": "tokens", "output_tokens": num_tokens}}


def word_errors(ref: str, hyp: str) -> int:
    """Word-level edit distance (substitutions + insertions + deletions): the numerator of the word error rate."""
    r, h = ref.split(), hyp.split()
    d = list(range(len(h) + 1))
    for i in range(1, len(r) + 1):
        prev, d[0] = d[0], i
        for j in range(1, len(h) + 1):
            prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (r[i - 1] != h[j - 1]))
    return d[len(h)]
