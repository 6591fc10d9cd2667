"""``POST /v1/audio/transcriptions`` (OpenAI's form upload) for a server started on a Whisper model.

The form has ``file`` (a WAV upload), ``model``, ``language``, ``response_format`` (``json`` | ``text`` |
``verbose_json``) and ``temperature``. The upload is decoded and turned into log-mel features in a
worker thread (never on the event loop), then the request joins the engine like any other: its
encoder runs once when it is admitted and its decoder is batched with everything else running.
A server whose model is not a Whisper model answers 400 naming ``model``.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, File, Form, UploadFile
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from forwardpass.audio import AudioError, duration_seconds, read_wav
from forwardpass.engine.frontend.async_engine import AsyncLLMEngine
from forwardpass.engine.frontend.multimodal import encoder_input_for
from forwardpass.errors import ForwardpassError, ValidationError
from forwardpass.loader.spec import ModelSpec, load_model_spec
from forwardpass.sampling.params import SamplingParams
from forwardpass.server.errors import error_response
from forwardpass.server.serving import Serving
from forwardpass.transcription import RESPONSE_FORMATS, transcription_body, transcription_prompt

MAX_AUDIO_BYTES = 25 * 1024 * 1024  # OpenAI's upload limit
MAX_AUDIO_SECONDS = 600.0  # decoding and resampling cost grows with it; the model hears its window only


def transcriptions_router(engine: AsyncLLMEngine, serving: Serving) -> APIRouter:
    router = APIRouter()
    spec_cache: list[ModelSpec] = []

    def speech_spec() -> ModelSpec:
        if not spec_cache:
            spec_cache.append(load_model_spec(engine.model_dir))
        spec = spec_cache[0]
        if spec.whisper is None:
            raise ValidationError(
                f"this server's model ({spec.architecture or 'a decoder'}) does not transcribe "
                "audio; start `forwardpass serve --model DIR` on a Whisper model",
                param="model",
            )
        return spec

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
        return encoder_input_for(spec, {"audio": (samples, rate)}), duration

    @router.post("/v1/audio/transcriptions", response_model=None)
    async def transcriptions(
        file: Annotated[UploadFile, File(description="the audio (WAV)")],
        model: Annotated[str | None, Form()] = None,
        language: Annotated[str | None, Form()] = None,
        response_format: Annotated[str, Form()] = "json",
        temperature: Annotated[float, Form()] = 0.0,
    ) -> Response:
        serving.resolve_model(model)
        if response_format not in RESPONSE_FORMATS:
            raise ValidationError(
                f"response_format must be one of {list(RESPONSE_FORMATS)}, got {response_format!r}",
                param="response_format",
            )
        if not 0.0 <= temperature <= 2.0:
            raise ValidationError(f"temperature must be in [0, 2], got {temperature}", param="temperature")
        spec = speech_spec()
        assert spec.whisper is not None
        lang = language or "en"
        prompt = transcription_prompt(engine.tokenizer, lang)  # 400 naming language for an unknown one
        data = await file.read(MAX_AUDIO_BYTES + 1)
        if len(data) > MAX_AUDIO_BYTES:
            return error_response(
                413, f"file: the upload is larger than {MAX_AUDIO_BYTES} bytes", param="file"
            )
        if not data:
            raise ValidationError("file: the upload is empty", param="file")
        features, duration = await serving.off_loop(prepare, data, spec)
        room = engine.max_model_len - len(prompt)
        params = SamplingParams(temperature=temperature, max_tokens=room)
        stream = await engine.add_request(
            prompt, params, f"transcription-{uuid.uuid4().hex}", encoder_input=features
        )
        final = None
        try:
            async for out in stream:
                final = out
        finally:
            stream.close()
        if final is None:
            raise ForwardpassError("the engine returned no output for this transcription")
        result = final.outputs[0]
        body = transcription_body(
            result.text,
            response_format,
            language=lang,
            duration=duration,
            window=spec.whisper.encoder_seconds,
            num_tokens=len(result.token_ids),
        )
        return PlainTextResponse(body) if isinstance(body, str) else JSONResponse(body)

    return router
