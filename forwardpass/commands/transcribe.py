"""``forwardpass transcribe AUDIO.wav``: speech to text with a Whisper model (default: the embedded one)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "transcribe", help="transcribe a WAV file with a Whisper model (default: the embedded one)"
    )
    p.add_argument("audio", help="a WAV file (PCM; other formats need the soundfile package)")
    p.add_argument(
        "--model",
        default=None,
        help="a Whisper model directory (default: the embedded speech model, forwardpass/assets/speech)",
    )
    p.add_argument("--language", default="en", help="the spoken language's code (default: en)")
    p.add_argument(
        "--max-tokens", type=int, default=None, help="the most tokens to write (default: the model's limit)"
    )
    p.add_argument(
        "--response-format",
        default="text",
        choices=["text", "json", "verbose_json"],
        help="text (default) or OpenAI's JSON forms",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json
    import sys
    from pathlib import Path

    from forwardpass import LLM, SamplingParams
    from forwardpass.audio import AudioError, duration_seconds, read_wav
    from forwardpass.commands._common import check_device
    from forwardpass.errors import ValidationError
    from forwardpass.transcription import default_speech_model_path, transcription_body, transcription_prompt

    path = Path(args.audio)
    if not path.is_file():
        raise ValidationError(f"{path}: no such file", param="audio")
    try:
        samples, rate = read_wav(path)
    except AudioError as exc:
        raise ValidationError(f"{path}: {exc}", param="audio") from None
    # one file, one request: one cross-attention slot (30 s Whisper large keeps ~0.5 GB of cross K/V per request)
    llm = LLM(args.model or default_speech_model_path(), device=check_device(args.device), max_num_seqs=1)
    spec = llm.engine.spec
    if spec.whisper is None:
        raise ValidationError(
            f"{args.model} is not a Whisper model (config.json model_type 'whisper')", param="model"
        )
    prompt = transcription_prompt(llm.get_tokenizer(), args.language)
    duration, window = duration_seconds(samples, rate), spec.whisper.encoder_seconds
    if duration > window:
        print(
            f"[note: this model hears {window:g} s of audio; the last {duration - window:.1f} s are not "
            "transcribed]",
            file=sys.stderr,
        )
    room = llm.engine.max_model_len - len(prompt)
    params = SamplingParams(temperature=0.0, max_tokens=min(args.max_tokens or room, room))
    out = llm.generate(
        {"prompt_token_ids": prompt, "multi_modal_data": {"audio": (samples, rate)}}, params, use_tqdm=False
    )[0].outputs[0]
    body = transcription_body(
        out.text,
        args.response_format,
        language=args.language,
        duration=duration,
        window=window,
        num_tokens=len(out.token_ids),
    )
    print(body if isinstance(body, str) else json.dumps(body, indent=2))
    return 0
