"""Long-form transcription as Whisper does it: 30-s windows, seeking by the last timestamp, fallbacks.

The algorithm is openai-whisper's ``transcribe()`` as faster-whisper runs it (the oracle of our tests):

* the whole clip's log-mel features are computed once (``audio.log_mel_frames``) and the encoder reads one
  window of ``2 · max_source_positions`` frames (30 s) at a time, starting at ``seek``;
* each window's decoder prompt is ``<|startofprev|>`` + the text of the previous windows (when conditioning on
  it; at most half the decoder's context) + ``<|startoftranscript|>`` (+ language and task on multilingual
  models) (+ ``<|notimestamps|>`` without timestamps), decoded under Whisper's logit rules
  (``sampling/whisper_rules.py``);
* the window's tokens are cut into segments at each pair of consecutive timestamps; ``seek`` moves to the last
  timestamp (an unfinished segment is decoded again in the next window), or past the window when the output
  ends with a single timestamp (no speech after it) or has no timestamps;
* a window whose text compresses too well (gzip ratio above 2.4: repetition) or whose average log-probability
  is below -1 is decoded again at the next temperature (0, 0.2, ..., 1.0, best of 5 samples); one whose
  ``<|nospeech|>`` probability is above 0.6 with a low log-probability is skipped as silence.

It is written as a generator that yields :class:`DecodeRequest` and receives each request's ``RequestOutput``,
so one algorithm serves the offline engine (``transcription.transcribe``) and the server's asynchronous engine
(``server/transcriptions.py``); it never touches an engine itself.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import torch

from forwardpass.audio import mel_window
from forwardpass.errors import ValidationError
from forwardpass.loader.tokenizer import Tokenizer
from forwardpass.sampling.params import SamplingParams
from forwardpass.sampling.whisper_rules import WhisperRules
from forwardpass.speech_bounds import snap_to_speech

TIME_PRECISION = 0.02  # seconds per timestamp token
FRAMES_PER_SECOND = 100  # log-mel frames (10 ms hops)
INPUT_STRIDE = 2  # log-mel frames per encoder position, and per timestamp step
TOP_LOGPROBS = 5  # enough for <|nospeech|>'s probability whenever it could pass a threshold above 1/6
_LANG = re.compile(r"^<\|([a-z]{2,3}|haw|yue)\|>$")


@dataclass(frozen=True)
class WhisperVocab:
    """The special tokens and decoding settings of one Whisper model (tokenizer, generation_config)."""

    eot: int
    sot: int
    no_timestamps: int
    timestamp_begin: int | None  # None: the vocabulary has no timestamp tokens
    transcribe: int | None
    translate: int | None
    sot_prev: int | None
    no_speech: int | None
    languages: dict[str, int]
    multilingual: bool
    suppress: tuple[int, ...]
    suppress_begin: tuple[int, ...]
    max_length: int  # the decoder's positions (448)

    @classmethod
    def from_model(
        cls, tokenizer: Tokenizer | None, vocab_size: int, max_length: int, generation: dict[str, Any]
    ) -> WhisperVocab:
        if tokenizer is None:
            raise ValidationError(
                "this speech model has no tokenizer.json to build the decoder prompt", param="model"
            )

        def tid(text: str) -> int | None:
            found = tokenizer.token_to_id(text)
            return int(found) if found is not None else None

        need = {t: tid(t) for t in ("<|endoftext|>", "<|startoftranscript|>", "<|notimestamps|>")}
        missing = [t for t, i in need.items() if i is None]
        if missing:
            raise ValidationError(
                f"this model's tokenizer has no {missing[0]} token: is it a Whisper model?", param="model"
            )
        eot, sot, no_ts = (int(i) for i in need.values())  # type: ignore[arg-type]
        translate = tid("<|translate|>")
        languages = {str(k)[2:-2]: int(v) for k, v in (generation.get("lang_to_id") or {}).items()}
        # Whisper's order: the languages sit between sot and translate
        if not languages and translate is not None:
            names = {i: tokenizer.id_to_token(i) or "" for i in range(sot + 1, translate)}
            languages = {m.group(1): i for i, name in names.items() if (m := _LANG.match(name))}
        multilingual = generation.get("is_multilingual")
        specials = [
            tid(t)
            for t in (
                "<|transcribe|>",
                "<|translate|>",
                "<|startoftranscript|>",
                "<|startofprev|>",
                "<|startoflm|>",
                "<|nospeech|>",
                "<|nocaptions|>",
            )
        ]
        suppress = {int(i) for i in generation.get("suppress_tokens") or [] if int(i) >= 0}
        # never written, as openai-whisper and faster-whisper do
        suppress |= {i for i in specials if i is not None}
        return cls(
            eot=eot, sot=sot, no_timestamps=no_ts,
            timestamp_begin=no_ts + 1 if no_ts + 1 < vocab_size else None,
            transcribe=tid("<|transcribe|>"), translate=translate, sot_prev=tid("<|startofprev|>"),
            no_speech=tid("<|nospeech|>") if tid("<|nospeech|>") is not None else tid("<|nocaptions|>"),
            languages=languages, multilingual=bool(languages) if multilingual is None else bool(multilingual),
            suppress=tuple(sorted(suppress)),
            suppress_begin=tuple(int(i) for i in generation.get("begin_suppress_tokens") or []),
            max_length=max_length,
        )  # fmt: skip

    def check_language(self, language: str | None) -> str | None:
        """``language`` normalised (``None``: detect it), or a ValidationError naming ``language``."""
        if language is None or not language.strip():
            return None if self.multilingual else "en"
        lang = language.strip().lower()
        if lang not in self.languages and not (lang == "en" and not self.languages):
            raise ValidationError(
                f"language {language!r} is not one this model's tokenizer knows (no <|{lang}|> token)",
                param="language",
            )
        if not self.multilingual and lang != "en":
            raise ValidationError(
                f"this model is English-only; language {language!r} is not available", param="language"
            )
        return lang

    def sot_sequence(self, language: str | None, task: str) -> list[int]:
        if not self.multilingual:
            return [self.sot]
        task_id = self.transcribe if task == "transcribe" else self.translate
        if task_id is None or language not in self.languages:
            raise ValidationError(
                f"this model's tokenizer lacks the {task} or <|{language}|> token", param="model"
            )
        return [self.sot, self.languages[language], task_id]


@dataclass(frozen=True)
class TranscribeOptions:
    """openai-whisper's ``transcribe()`` settings (its defaults; faster-whisper's too)."""

    language: str | None = None  # None: detected from the first window (multilingual models), else "en"
    task: str = "transcribe"
    temperatures: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    best_of: int = 5
    compression_ratio_threshold: float | None = 2.4
    log_prob_threshold: float | None = -1.0
    no_speech_threshold: float | None = 0.6
    condition_on_previous_text: bool = True
    prompt_reset_on_temperature: float = 0.5
    initial_prompt: str | None = None
    without_timestamps: bool = False
    max_initial_timestamp: float = 1.0
    suppress_blank: bool = True
    #: fallback samples are drawn with seed ``seed + seek`` (the window's first frame): the same audio gives
    #: the same transcript; None draws fresh randomness
    seed: int | None = 0
    #: a last window shorter than the encoder's is padded with "zeros" (faster-whisper's features) or
    #: "silence" (openai-whisper's and transformers'); None: the reference of the checkpoint's format, zeros
    #: for CTranslate2 directories, silence otherwise (transcription.py resolves it)
    feature_padding: str | None = None
    #: move each segment's bounds onto the speech it holds (forwardpass/speech_bounds.py)
    snap_to_speech: bool = True


@dataclass
class Segment:
    id: int
    seek: int
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float


@dataclass
class Transcript:
    text: str
    segments: list[Segment]
    language: str
    duration: float
    num_tokens: int  # tokens the decoder wrote (every window, every fallback)
    windows: int = 0


@dataclass(frozen=True)
class DecodeRequest:
    """One decoder run: ``prompt`` over the encoder window ``features`` ``[mels, frames]``."""

    features: torch.Tensor
    prompt: list[int]
    params: SamplingParams


@dataclass
class _Decoded:
    tokens: list[int]  # without <|endoftext|>
    avg_logprob: float
    temperature: float
    compression_ratio: float
    no_speech_prob: float
    text: str = field(default="")


def compression_ratio(text: str) -> float:
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


def _no_speech_prob(vocab: WhisperVocab, out: Any, completion: Any, sot_index: int) -> float:
    """P(<|nospeech|>) right after <|startoftranscript|>, from the raw top tokens the engine reported (0 when
    it was not among them: then it is below the fifth likeliest token's probability, far below any
    threshold)."""
    import math

    if vocab.no_speech is None:
        return 0.0
    if sot_index == len(out.prompt_token_ids) - 1:  # the first generated token's distribution
        top = completion.logprobs[0] if completion.logprobs else {}
    else:
        top = (out.prompt_logprobs or [None] * (sot_index + 2))[sot_index + 1] or {}
    entry = top.get(vocab.no_speech)
    return math.exp(entry.logprob) if entry is not None else 0.0


def _decode_with_fallback(
    vocab: WhisperVocab,
    tokenizer: Tokenizer,
    options: TranscribeOptions,
    features: torch.Tensor,
    prompt: list[int],
    counter: list[int],
    seek: int,
) -> Generator[DecodeRequest, Any, _Decoded]:
    sot_index = prompt.index(vocab.sot)
    timestamps = not options.without_timestamps and vocab.timestamp_begin is not None
    rules = WhisperRules(
        eot=vocab.eot,
        suppress=vocab.suppress,
        suppress_begin=vocab.suppress_begin if options.suppress_blank else (),
        timestamp_begin=vocab.timestamp_begin if timestamps else None,
        no_timestamps=vocab.no_timestamps,
        max_initial_timestamp=round(options.max_initial_timestamp / TIME_PRECISION),
    )
    max_tokens = min(vocab.max_length // 2, vocab.max_length - len(prompt))
    if max_tokens < 1:
        raise ValidationError("the prompt fills the decoder's context; shorten it", param="prompt")
    tried: list[_Decoded] = []
    for temperature in options.temperatures:
        sampled = temperature > 0
        params = SamplingParams(
            n=options.best_of if sampled else 1,
            temperature=temperature,
            max_tokens=max_tokens,
            whisper_rules=rules,
            logprobs=TOP_LOGPROBS,
            prompt_logprobs=TOP_LOGPROBS if sot_index < len(prompt) - 1 else None,
            seed=None if options.seed is None else options.seed + seek,
            skip_special_tokens=True,
        )
        out = yield DecodeRequest(features, prompt, params)
        best = None
        for c in out.outputs:  # the best sample by mean logprob (CTranslate2's score with length_penalty 1)
            lps = [next(iter(d.values())).logprob for d in c.logprobs or []]
            tokens = [t for t in c.token_ids if t != vocab.eot]
            counter[0] += len(c.token_ids)
            score = sum(lps) / max(len(tokens), 1)
            if best is None or score > best[0]:
                best = (score, c, tokens, sum(lps))
        assert best is not None
        _, c, tokens, total = best
        text = tokenizer.decode_raw([t for t in tokens if t < vocab.eot]).strip()
        decoded = _Decoded(
            tokens,
            total / (len(tokens) + 1),
            temperature,
            compression_ratio(text),
            _no_speech_prob(vocab, out, c, sot_index),
            text,
        )
        tried.append(decoded)
        too_repetitive = (
            options.compression_ratio_threshold is not None
            and decoded.compression_ratio > options.compression_ratio_threshold
        )
        too_unlikely = (
            options.log_prob_threshold is not None and decoded.avg_logprob < options.log_prob_threshold
        )
        silence = (
            options.no_speech_threshold is not None
            and decoded.no_speech_prob > options.no_speech_threshold
            and too_unlikely
        )
        if silence or not (too_repetitive or too_unlikely):
            return decoded
    # every temperature failed: the likeliest of those that were not repetitive (else of all), as
    # faster-whisper
    limit = options.compression_ratio_threshold
    pool = [d for d in tried if limit is None or d.compression_ratio <= limit] or tried
    pick = max(pool, key=lambda d: d.avg_logprob)
    pick.temperature = options.temperatures[-1]
    return pick


def _split(
    vocab: WhisperVocab,
    tokens: list[int],
    seek: int,
    window_frames: int,
    segment_frames: int,
) -> tuple[list[tuple[float, float, list[int]]], int]:
    """The window's ``(start, end, tokens)`` segments (seconds from the window's start) and the next
    ``seek``."""
    ts = vocab.timestamp_begin
    if ts is None or not tokens or all(t < ts for t in tokens):
        return [(0.0, segment_frames / FRAMES_PER_SECOND, tokens)], seek + segment_frames
    single_ending = len(tokens) >= 2 and tokens[-2] < ts <= tokens[-1]
    cuts = [i for i in range(1, len(tokens)) if tokens[i] >= ts and tokens[i - 1] >= ts]
    if not cuts:  # one open segment: it lasts until its last timestamp, or the whole window
        stamps = [t for t in tokens if t >= ts]
        end = (
            (stamps[-1] - ts) * TIME_PRECISION
            if stamps and stamps[-1] != ts
            else segment_frames / FRAMES_PER_SECOND
        )
        return [(0.0, end, tokens)], seek + segment_frames
    if single_ending:
        cuts.append(len(tokens))
    segments, last = [], 0
    for cut in cuts:
        part = tokens[last:cut]
        segments.append(((part[0] - ts) * TIME_PRECISION, (part[-1] - ts) * TIME_PRECISION, part))
        last = cut
    if single_ending:  # nothing is said after the last timestamp: on to the next window
        return segments, seek + segment_frames
    # redo the unfinished segment from its start
    return segments, seek + (tokens[last - 1] - ts) * INPUT_STRIDE


def transcribe_windows(
    mel: torch.Tensor,
    duration: float,
    vocab: WhisperVocab,
    tokenizer: Tokenizer,
    options: TranscribeOptions,
    window_frames: int,
) -> Generator[DecodeRequest, Any, Transcript]:
    """The transcript of the whole clip whose features are ``mel`` ``[mels, frames]``
    (``audio.log_mel_frames``)."""
    if options.task not in ("transcribe", "translate"):
        raise ValidationError(f"task must be 'transcribe' or 'translate', got {options.task!r}", param="task")
    language = vocab.check_language(options.language)
    if options.feature_padding not in ("zeros", "silence"):
        raise ValidationError(
            f"feature_padding must be 'zeros' or 'silence', got {options.feature_padding!r}",
            param="feature_padding",
        )
    silence = options.feature_padding == "silence"
    timestamps = not options.without_timestamps and vocab.timestamp_begin is not None
    content_frames = mel.shape[-1] - 1
    counter = [0]
    # detect it from the first window: the likeliest language token after <|startoftranscript|>
    if language is None:
        out = yield DecodeRequest(
            mel_window(mel, 0, window_frames, silence),
            [vocab.sot],
            SamplingParams(temperature=0, max_tokens=1, allowed_token_ids=sorted(vocab.languages.values())),
        )
        by_id = {i: name for name, i in vocab.languages.items()}
        language = by_id[out.outputs[0].token_ids[0]]
    sot_sequence = vocab.sot_sequence(language, options.task)
    history: list[int] = []
    if options.initial_prompt:
        history = tokenizer.encode(" " + options.initial_prompt.strip(), add_special_tokens=False)
    reset_since, seek, segments, windows = 0, 0, [], 0
    while seek < content_frames:
        offset = seek / FRAMES_PER_SECOND
        size = min(window_frames, content_frames - seek)
        previous = history[reset_since:]
        prompt = (
            [vocab.sot_prev, *previous[-(vocab.max_length // 2 - 1) :]]
            if previous and vocab.sot_prev is not None
            else []
        )
        # a vocabulary without timestamp tokens decodes plain text: <|notimestamps|> is what such a model
        # knows
        prompt += sot_sequence + ([vocab.no_timestamps] if not timestamps else [])
        features = mel_window(mel, seek, window_frames, silence)
        decoded = yield from _decode_with_fallback(vocab, tokenizer, options, features, prompt, counter, seek)
        windows += 1
        if (
            options.no_speech_threshold is not None
            and decoded.no_speech_prob > options.no_speech_threshold
            and not (
                options.log_prob_threshold is not None and decoded.avg_logprob > options.log_prob_threshold
            )
        ):
            seek += size  # silence: on to the next window
            continue
        start_seek = seek
        parts, seek = _split(vocab, decoded.tokens, seek, window_frames, size)
        for start, end, tokens in parts:
            text = tokenizer.decode_raw([t for t in tokens if t < vocab.eot])
            if start == end or not text.strip():
                continue
            history.extend(tokens)
            segments.append(
                Segment(
                    len(segments),
                    start_seek,
                    round(offset + start, 3),
                    round(offset + end, 3),
                    text,
                    tokens,
                    decoded.temperature,
                    decoded.avg_logprob,
                    decoded.compression_ratio,
                    decoded.no_speech_prob,
                )
            )
        if (
            not options.condition_on_previous_text
            or decoded.temperature > options.prompt_reset_on_temperature
        ):
            reset_since = len(history)
    if options.snap_to_speech:
        snap_to_speech(segments, mel)
    text = "".join(s.text for s in segments).strip()
    return Transcript(text, segments, language, duration, counter[0], windows)
