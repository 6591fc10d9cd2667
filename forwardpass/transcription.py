"""What the ``transcribe`` command and ``POST /v1/audio/transcriptions`` share: the Whisper vocabulary of a
model, the offline driver of the long-form algorithm (``whisper_longform.py``), the default speech model, and
the response shapes (``json``, ``text``, ``verbose_json`` with segments, ``srt``, ``vtt``).

Whisper's decoder starts from special tokens that say what to do: ``<|startoftranscript|>``, on multilingual
models the language (``<|en|>``) and the task (``<|transcribe|>`` or ``<|translate|>``), and
``<|notimestamps|>`` for plain text. They are looked up in the model's own tokenizer, so a checkpoint whose
tokenizer lacks one gets an error that names it.
"""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from forwardpass.audio import AudioError, duration_seconds, log_mel_frames, to_mono_16k
from forwardpass.errors import ValidationError
from forwardpass.loader.jsonfile import read_json_object
from forwardpass.loader.paths import model_file
from forwardpass.loader.tokenizer import Tokenizer
from forwardpass.whisper_longform import (
    DecodeRequest,
    Segment,
    TranscribeOptions,
    Transcript,
    WhisperVocab,
    transcribe_windows,
)

if TYPE_CHECKING:
    from forwardpass.llm import LLM
    from forwardpass.models.model_spec import ModelSpec

RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
GRANULARITIES = ("segment",)  # word timestamps (alignment heads + DTW) are not implemented

__all__ = ["RESPONSE_FORMATS", "Segment", "TranscribeOptions", "Transcript", "WhisperVocab", "transcribe"]


def default_speech_model_path() -> Path:
    """The embedded speech model (``forwardpass/assets/speech``: a tiny Whisper trained here)."""
    return Path(__file__).resolve().parent / "assets" / "speech"


def speech_vocab(
    model_dir: str | Path, tokenizer: Tokenizer | None, spec: ModelSpec, max_length: int
) -> WhisperVocab:
    """The Whisper vocabulary of the model in ``model_dir`` (its generation_config.json: suppress ids,
    languages)."""
    path = model_file(model_dir, "generation_config.json")
    generation = read_json_object(path) if path.is_file() else {}
    return WhisperVocab.from_model(tokenizer, spec.vocab, max_length, generation)


def with_padding(options: TranscribeOptions, model_dir: str | Path) -> TranscribeOptions:
    """``options`` with ``feature_padding`` resolved for the model in ``model_dir``: faster-whisper's zeros
    for a CTranslate2 directory (the features its checkpoints are run with), openai-whisper's silence
    otherwise."""
    if options.feature_padding is not None:
        return options
    from dataclasses import replace

    from forwardpass.loader.ctranslate2 import is_converted_dir

    return replace(options, feature_padding="zeros" if is_converted_dir(model_dir) else "silence")


def temperature_schedule(temperature: float, increment: float = 0.2) -> tuple[float, ...]:
    """openai-whisper's fallback: ``temperature`` up to 1.0 in steps of ``increment`` (just it when > 1)."""
    if not 0.0 <= temperature <= 2.0:
        raise ValidationError(f"temperature must be in [0, 2], got {temperature}", param="temperature")
    steps = int(round((1.0 - temperature) / increment)) if temperature < 1.0 else 0
    return tuple(round(temperature + i * increment, 6) for i in range(steps + 1))


def transcription_prompt(
    tokenizer: Tokenizer | None, language: str | None = "en", task: str = "transcribe"
) -> list[int]:
    """Whisper's plain-text decoder prompt ``<|startoftranscript|><|LANG|><|TASK|><|notimestamps|>`` as ids
    (what the embedded model was trained on; English-only checkpoints take it without language and task)."""
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


def prepare_audio(samples: np.ndarray, rate: int, spec: ModelSpec) -> tuple[Any, float]:
    """``(log-mel features of the whole clip, duration in seconds)`` of ``samples`` at ``rate``."""
    assert spec.whisper is not None
    try:
        audio = to_mono_16k(np.asarray(samples), int(rate))
    except AudioError as exc:
        raise ValidationError(f"audio: {exc}", param="file") from exc
    return log_mel_frames(audio, spec.whisper.num_mel_bins), duration_seconds(samples, rate)


def transcribe(
    llm: LLM, samples: np.ndarray, rate: int, options: TranscribeOptions | None = None
) -> Transcript:
    """The transcript of a whole clip with the Whisper model ``llm`` runs: one engine request per window."""
    return transcribe_batch(llm, [(samples, rate)], options)[0]


def transcribe_batch(
    llm: LLM,
    clips: list[tuple[np.ndarray, int]],
    options: TranscribeOptions | None = None,
) -> list[Transcript]:
    """Transcripts of several clips, their windows decoded side by side: each round submits every clip's next
    decode request to the engine at once (its encoder and decoder batch them; ``max_num_seqs`` bounds how many
    run together)."""
    engine = llm.engine
    spec = engine.spec
    if spec.whisper is None:
        raise ValidationError(
            f"{spec.name} is not a Whisper model (config.json model_type 'whisper')", param="model"
        )
    assert spec.max_position_embeddings is not None
    tokenizer = llm.get_tokenizer()
    vocab = speech_vocab(
        engine.model_dir, tokenizer, spec, min(spec.max_position_embeddings, engine.max_model_len)
    )
    options = with_padding(options or TranscribeOptions(), engine.model_dir)
    steps = []
    for samples, rate in clips:
        mel, duration = prepare_audio(samples, rate, spec)
        steps.append(
            transcribe_windows(mel, duration, vocab, tokenizer, options, spec.whisper.encoder_input_frames)
        )
    results: dict[int, Transcript] = {}
    pending: dict[int, DecodeRequest] = {}
    for i, gen in enumerate(steps):
        _advance(gen, None, i, pending, results)
    while pending:
        ids = list(pending)
        outs = llm.generate(
            [
                {
                    "prompt_token_ids": pending[i].prompt,
                    "multi_modal_data": {"input_features": pending[i].features},
                }
                for i in ids
            ],
            [pending[i].params for i in ids],
            use_tqdm=False,
        )
        for i, out in zip(ids, outs, strict=True):
            _advance(steps[i], out, i, pending, results)
    return [results[i] for i in range(len(steps))]


def _advance(
    gen: Generator[DecodeRequest, Any, Transcript],
    answer: Any,
    i: int,
    pending: dict[int, DecodeRequest],
    results: dict[int, Transcript],
) -> None:
    """Give generator ``i`` its answer (None: start it); keep its next request, or its transcript if done."""
    try:
        pending[i] = next(gen) if answer is None else gen.send(answer)
    except StopIteration as done:
        pending.pop(i, None)
        results[i] = done.value


# ----- response bodies
# ------------------------------------------------------------------------------------------
def _clock(seconds: float, decimal: str) -> str:
    ms = int(round(max(seconds, 0.0) * 1000))
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, ms = divmod(rest, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{decimal}{ms:03d}"


def subtitles(transcript: Transcript, response_format: str) -> str:
    """SubRip (``srt``) or WebVTT (``vtt``) cues, one per segment."""
    srt = response_format == "srt"
    cues = []
    for i, seg in enumerate(transcript.segments, start=1):
        times = f"{_clock(seg.start, ',' if srt else '.')} --> {_clock(seg.end, ',' if srt else '.')}"
        cues.append((f"{i}\n" if srt else "") + f"{times}\n{seg.text.strip()}\n")
    return ("" if srt else "WEBVTT\n\n") + "\n".join(cues)


def transcription_body(
    transcript: Transcript, response_format: str, task: str = "transcribe"
) -> dict[str, Any] | str:
    """OpenAI's response for ``response_format``: ``{"text"}``, the bare text, the verbose form with segments
    (start, end, text and Whisper's per-window statistics), or subtitles."""
    usage = {"type": "tokens", "output_tokens": transcript.num_tokens}
    if response_format == "text":
        return transcript.text
    if response_format in ("srt", "vtt"):
        return subtitles(transcript, response_format)
    if response_format == "verbose_json":
        return {
            "task": task,
            "language": transcript.language,
            "duration": round(transcript.duration, 3),
            "text": transcript.text,
            "segments": [
                {
                    "id": s.id,
                    "seek": s.seek,
                    "start": round(s.start, 3),
                    "end": round(s.end, 3),
                    "text": s.text,
                    "tokens": s.tokens,
                    "temperature": s.temperature,
                    "avg_logprob": round(s.avg_logprob, 6),
                    "compression_ratio": round(s.compression_ratio, 6),
                    "no_speech_prob": round(s.no_speech_prob, 6),
                }
                for s in transcript.segments
            ],
            "usage": usage,
        }
    return {"text": transcript.text, "usage": usage}


def check_response_format(response_format: str, granularities: list[str] | None = None) -> None:
    if response_format not in RESPONSE_FORMATS:
        raise ValidationError(
            f"response_format must be one of {list(RESPONSE_FORMATS)}, got {response_format!r}",
            param="response_format",
        )
    for g in granularities or []:
        if g not in GRANULARITIES:
            raise ValidationError(
                f"timestamp_granularities: {g!r} is not supported (only 'segment'; word "
                "timestamps are not implemented)",
                param="timestamp_granularities",
            )
    if granularities and response_format != "verbose_json":
        raise ValidationError(
            "timestamp_granularities needs response_format 'verbose_json'", param="timestamp_granularities"
        )


def word_errors(ref: str, hyp: str) -> int:
    """Word-level edit distance (substitutions + insertions + deletions): the word error rate's numerator."""
    r, h = ref.split(), hyp.split()
    d = list(range(len(h) + 1))
    for i in range(1, len(r) + 1):
        prev, d[0] = d[0], i
        for j in range(1, len(h) + 1):
            prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (r[i - 1] != h[j - 1]))
    return d[len(h)]
