"""``POST /v1/audio/transcriptions`` (OpenAI's form upload) for a server started on a Whisper model.

The form has ``file`` (a WAV upload), ``model``, ``language``, ``prompt`` (text the speech continues),
``response_format`` (``json`` | ``text`` | ``verbose_json`` | ``srt`` | ``vtt``), ``temperature`` (the first
of Whisper's fallback temperatures) and ``timestamp_granularities[]`` (``segment``; with ``verbose_json``).
The upload is decoded and turned into log-mel features in a worker thread (never on the event loop); then the
audio is transcribed window by window as Whisper does (``forwardpass/whisper_longform.py``): each window is
one request that joins the engine like any other (its encoder runs once when it is admitted, its decoder is
batched with everything else running). A server whose model is not a Whisper model answers 400 naming
``model``.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, File, Form, UploadFile
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from forwardpass.audio import AudioError, duration_seconds, read_wav
from forwardpass.engine.frontend.async_engine import AsyncLLMEngine
from forwardpass.errors import ForwardpassError, ValidationError
from forwardpass.models.model_spec import ModelSpec
from forwardpass.server.errors import error_response
from forwardpass.server.serving import Serving
from forwardpass.transcription import (
    TranscribeOptions,
    WhisperVocab,
    check_response_format,
    prepare_audio,
    speech_vocab,
    temperature_schedule,
    transcription_body,
    with_padding,
)
from forwardpass.whisper_longform import DecodeRequest, Transcript, transcribe_windows

MAX_AUDIO_BYTES = 25 * 1024 * 1024  # OpenAI's upload limit
MAX_AUDIO_SECONDS = 600.0  # decoding, resampling and the log-mel features grow with it


def transcriptions_router(engine: AsyncLLMEngine, serving: Serving) -> APIRouter:
    router = APIRouter()
    cache: list[tuple[ModelSpec, WhisperVocab]] = []

    def speech_model() -> tuple[ModelSpec, WhisperVocab]:
        if not cache:
            info = engine.info  # the engine is up: a request is being served
            assert info is not None and info.model_spec is not None, "the engine has not started"
            spec = info.model_spec
            if spec.whisper is None:
                raise ValidationError(
                    f"this server's model ({spec.architecture or 'a decoder'}) does not transcribe "
                    "audio; start `forwardpass serve --model DIR` on a Whisper model",
                    param="model",
                )
            assert spec.max_position_embeddings is not None
            length = min(spec.max_position_embeddings, engine.max_model_len)
            cache.append((spec, speech_vocab(engine.model_dir, engine.tokenizer, spec, length)))
        return cache[0]

    def prepare(data: bytes, spec: ModelSpec) -> tuple[Any, float]:
        try:
            samples, rate = read_wav(data)
        except AudioError as exc:
            raise ValidationError(f"file: {exc}", param="file") from None
        duration = duration_seconds(samples, rate)
        if duration > MAX_AUDIO_SECONDS:
            raise ValidationError(
                f"file: the audio lasts {duration:.0f} s; the limit is {MAX_AUDIO_SECONDS:g} s", param="file"
            )
        return prepare_audio(samples, rate, spec)

    async def decode(request: DecodeRequest) -> Any:
        stream = await engine.add_request(
            request.prompt,
            request.params,
            f"transcription-{uuid.uuid4().hex}",
            encoder_input=request.features,
        )
        final = None
        try:
            async for out in stream:
                final = out
        finally:
            stream.close()
        if final is None:
            raise ForwardpassError("the engine returned no output for this transcription")
        return final

    @router.post("/v1/audio/transcriptions", response_model=None)
    async def transcriptions(
        file: Annotated[UploadFile, File(description="the audio (WAV)")],
        model: Annotated[str | None, Form()] = None,
        language: Annotated[str | None, Form()] = None,
        prompt: Annotated[str | None, Form()] = None,
        response_format: Annotated[str, Form()] = "json",
        temperature: Annotated[float, Form()] = 0.0,
        granularities: Annotated[list[str] | None, Form(alias="timestamp_granularities[]")] = None,
        granularities_plain: Annotated[list[str] | None, Form(alias="timestamp_granularities")] = None,
    ) -> Response:
        serving.resolve_model(model)
        check_response_format(response_format, (granularities or []) + (granularities_plain or []))
        temperatures = temperature_schedule(temperature)
        spec, vocab = speech_model()
        assert spec.whisper is not None
        options = with_padding(
            TranscribeOptions(language=language, initial_prompt=prompt or None, temperatures=temperatures),
            engine.model_dir,
        )
        vocab.check_language(language)  # 400 naming language for an unknown one, before the upload is read
        data = await file.read(MAX_AUDIO_BYTES + 1)
        if len(data) > MAX_AUDIO_BYTES:
            return error_response(
                413, f"file: the upload is larger than {MAX_AUDIO_BYTES} bytes", param="file"
            )
        if not data:
            raise ValidationError("file: the upload is empty", param="file")
        mel, duration = await serving.off_loop(prepare, data, spec)
        assert engine.tokenizer is not None  # speech_vocab refused a model without one
        steps = transcribe_windows(
            mel, duration, vocab, engine.tokenizer, options, spec.whisper.encoder_input_frames
        )
        try:
            request = next(steps)
            while True:
                request = steps.send(await decode(request))
        except StopIteration as done:
            transcript: Transcript = done.value
        body = transcription_body(transcript, response_format)
        if isinstance(body, str):
            kind = {"srt": "application/x-subrip", "vtt": "text/vtt"}.get(response_format, "text/plain")
            return PlainTextResponse(body, media_type=kind)
        return JSONResponse(body)

    return router
