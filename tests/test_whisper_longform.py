"""The pieces of long-form transcription that need no model: cutting a window's tokens into segments and the
next seek (``whisper_longform._split``), segment bounds snapped to speech runs (``speech_bounds.py``), the
temperature schedule and the subtitle formats."""

from __future__ import annotations

import pytest
import torch

from forwardpass.speech_bounds import snap_to_speech
from forwardpass.transcription import subtitles, temperature_schedule
from forwardpass.whisper_longform import Segment, Transcript, WhisperVocab, _split

TS = 100  # <|0.00|> in this made-up vocabulary; <|0.02 * k|> is TS + k
VOCAB = WhisperVocab(
    eot=90,
    sot=91,
    no_timestamps=99,
    timestamp_begin=TS,
    transcribe=92,
    translate=93,
    sot_prev=94,
    no_speech=95,
    languages={},
    multilingual=False,
    suppress=(),
    suppress_begin=(),
    max_length=448,
)


def test_split_at_consecutive_timestamps_and_seek_to_the_last():
    # <|0.00|> a b <|1.00|><|1.00|> c <|2.00|>  <|2.50|> d   (the last segment unfinished)
    tokens = [TS, 1, 2, TS + 50, TS + 50, 3, TS + 100, TS + 125, 4]
    parts, seek = _split(VOCAB, tokens, seek=300, window_frames=3000, segment_frames=3000)
    assert [(a, b) for a, b, _ in parts] == [(0.0, 1.0), (1.0, 2.0)]
    assert seek == 300 + 100 * 2  # back to <|2.00|>, the end of the last finished segment (2 frames a step)


def test_single_timestamp_ending_and_plain_text_move_past_the_window():
    parts, seek = _split(VOCAB, [TS, 1, TS + 40, TS + 40, 2, TS + 90], 0, 3000, 1200)
    assert [(a, b) for a, b, _ in parts] == [(0.0, 0.8), (0.8, 1.8)] and seek == 1200
    parts, seek = _split(VOCAB, [1, 2, 3], 500, 3000, 3000)
    assert parts == [(0.0, 30.0, [1, 2, 3])] and seek == 3500


def _mel(loud: list[tuple[int, int]], frames: int = 800) -> torch.Tensor:
    mel = torch.full((80, frames), -1.0)
    for a, b in loud:
        mel[:, a:b] = 1.0
    return mel


def _seg(start: float, end: float) -> Segment:
    return Segment(0, 0, start, end, "x", [], 0.0, 0.0, 1.0, 0.0)


def test_bounds_snap_to_the_speech_each_segment_holds():
    # speech at 1.0-3.0 s and 3.5-6.0 s; Whisper's bounds: 0-3.8 (late end, into the second sentence), 3.8-7.0
    segments = [_seg(0.0, 3.8), _seg(3.8, 7.0)]
    snap_to_speech(segments, _mel([(100, 300), (350, 600)]))
    assert [(s.start, s.end) for s in segments] == [(1.0, 3.0), (3.5, 6.0)]
    # a pause shorter than 0.25 s is inside one run; a segment without speech keeps its bounds
    segments = [_seg(0.5, 2.6), _seg(6.5, 7.5)]
    snap_to_speech(segments, _mel([(100, 150), (160, 250)]))
    assert [(s.start, s.end) for s in segments] == [(1.0, 2.5), (6.5, 7.5)]


def test_temperature_schedule_and_subtitles():
    assert temperature_schedule(0.0) == (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    assert temperature_schedule(0.5) == (0.5, 0.7, 0.9) and temperature_schedule(1.5) == (1.5,)
    with pytest.raises(ValueError, match="temperature"):
        temperature_schedule(3.0)
    t = Transcript("a b", [_seg(0.0, 1.5), _seg(61.25, 3725.0)], "en", 3725.0, 4)
    assert (
        subtitles(t, "srt") == "1\n00:00:00,000 --> 00:00:01,500\nx\n\n2\n00:01:01,250 --> 01:02:05,000\nx\n"
    )
    assert subtitles(t, "vtt").startswith("WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nx\n")
