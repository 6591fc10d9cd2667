"""Speech synthesised with espeak-ng: sentences in several voices and speeds, and long recordings made of them
with known silences between (tests of real speech recognition: tests/test_whisper_tiny_en.py)."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from forwardpass.audio import read_wav, to_mono_16k

ESPEAK = shutil.which("espeak-ng")

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "please call stella and ask her to bring these things with her from the store",
    "she sells sea shells by the sea shore",
    "the weather is lovely today so we are going for a walk in the park",
    "a forward pass reads every weight once",
    "my favourite colour is green and my sister likes blue",
    "the train to london leaves at noon every day",
    "we need more coffee before the meeting starts",
    "can you hear me clearly through this old microphone",
    "the children played football in the garden until dark",
    "turn left at the next corner and then go straight ahead",
    "this book tells the story of a small village by the river",
    "the doctor said that i should drink more water",
    "our team finished the project two weeks early",
    "it was raining when we arrived at the airport",
    "the cat sat quietly on the warm kitchen floor",
    "please remember to lock the door when you leave",
    "the music was so loud that nobody could talk",
    "he opened the window to let some fresh air in",
    "good morning everyone and welcome to the show",
    "the museum is closed on mondays and public holidays",
    "they planted tomatoes and beans in the spring",
    "the old bridge was built more than a century ago",
    "learning a new language takes time and patience",
]
VOICES = ["en-us", "en-gb", "en+f3", "en-us+m3", "en+f2", "en-gb+m4"]
SPEEDS = [130, 145, 160, 175, 190]


@dataclass(frozen=True)
class Utterance:
    text: str
    voice: str
    speed: int


def utterances(n: int = len(SENTENCES)) -> list[Utterance]:
    """``n`` sentences, each in its own voice and speed (cycling through both lists)."""
    return [
        Utterance(SENTENCES[i % len(SENTENCES)], VOICES[i % len(VOICES)], SPEEDS[(i * 2) % len(SPEEDS)])
        for i in range(n)
    ]


def speak(u: Utterance, path: Path) -> np.ndarray:
    """The utterance as mono 16 kHz float32 samples (espeak-ng writes 22.05 kHz WAV; resampled here)."""
    assert ESPEAK is not None, "espeak-ng is not installed"
    subprocess.run(
        [ESPEAK, "-v", u.voice, "-s", str(u.speed), "-w", str(path), u.text], check=True, capture_output=True
    )
    samples, rate = read_wav(path)
    return to_mono_16k(samples, rate)


def trim(samples: np.ndarray, level: float = 1e-3) -> np.ndarray:
    """Without espeak-ng's leading and trailing silence, so where the speech starts and ends is known."""
    loud = np.flatnonzero(np.abs(samples) > level)
    return samples[loud[0] : loud[-1] + 1] if loud.size else samples[:0]


def normalise(text: str) -> str:
    """Lower case, punctuation as spaces (hyphens, commas, full stops), one space between words."""
    return " ".join(re.sub(r"[^a-z0-9' ]+", " ", text.lower().replace("-", " ")).split())


def join_with_silences(
    clips: list[np.ndarray],
    gaps: list[float],
    rate: int = 16_000,
) -> tuple[np.ndarray, list[tuple[float, float]]]:
    """``gaps[0]`` s of silence, clip 0, ``gaps[1]`` s, clip 1, ...: the audio and each clip's (start, end)
    s."""
    parts, spans, t = [], [], 0
    for clip, gap in zip(clips, gaps, strict=True):
        parts += [np.zeros(int(gap * rate), np.float32), clip]
        t += int(gap * rate)
        spans.append((t / rate, (t + len(clip)) / rate))
        t += len(clip)
    parts.append(np.zeros(rate, np.float32))
    return np.concatenate(parts), spans
