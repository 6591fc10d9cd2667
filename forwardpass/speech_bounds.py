"""Segment bounds snapped to the speech they hold (``TranscribeOptions.snap_to_speech``, on by default).

Whisper's timestamps are tokens of 20 ms, but where it puts them is loose: a segment often starts where the
previous one ended and ends well into the pause after it, or a little into the next sentence (tiny.en writes
whole seconds at pauses). The audio says where the speech is. A log-mel frame whose loudest band is
``QUIET_DECADES`` (45 dB) below the clip's loudest frame is quiet; loud frames separated by less than
``MIN_PAUSE`` of quiet ones form one speech run. Then each bound of each segment, in order:

* in a pause: it moves inward to the nearest speech of its segment (the first run's start, the last run's
  end);
* inside a run: the run belongs to the segment holding most of it. A start moves back to its run's start
  when the run is its segment's (at most ``MAX_SHIFT``), else forward past it; an end moves on to its run's
  end when the run is its segment's (at most ``MAX_SHIFT``), else back to the end of the run before.

No bound crosses the previous segment's end, so segments keep their order and never overlap. A segment without
speech, or audio whose noise floor is that loud, keeps Whisper's bounds.
"""

from __future__ import annotations

from typing import Protocol

import torch

FRAMES_PER_SECOND = 100
QUIET_DECADES = 4.5  # 10 dB each
MIN_PAUSE = 25  # frames (0.25 s): shorter quiet stretches are gaps between words, not between sentences
MAX_SHIFT = 100  # frames (1 s): how far a bound may move outward


class _Bounded(Protocol):
    start: float
    end: float


def speech_runs(mel: torch.Tensor) -> list[tuple[int, int]]:
    """``[(first, end)]`` frame ranges of speech in ``mel`` (``[mels, frames]``, Whisper's log-mel)."""
    level = mel[:, :-1].amax(dim=0) * 4.0  # features are (log10 + 4) / 4: decades; the last frame is the
    # 160 samples of padding after the clip (audio.log_mel_frames): no bound goes past the audio's end
    loud = torch.nonzero(level > level.max() - QUIET_DECADES).squeeze(1).tolist()
    runs: list[tuple[int, int]] = []
    for frame in loud:
        if runs and frame - runs[-1][1] < MIN_PAUSE:
            runs[-1] = (runs[-1][0], frame + 1)
        else:
            runs.append((frame, frame + 1))
    return runs


def snap_to_speech(segments: list[_Bounded], mel: torch.Tensor) -> None:
    """Move the bounds of ``segments`` (seconds, in order) onto the speech runs of ``mel``, in place."""
    runs = speech_runs(mel)
    floor = 0
    for seg in segments:
        s, e = round(seg.start * FRAMES_PER_SECOND), round(seg.end * FRAMES_PER_SECOND)
        mine = [r for r in runs if r[1] > s and r[0] < e]
        if not mine:
            continue
        start, end = mine[0][0], mine[-1][1]
        if start < s:  # a run crosses the start: ours if most of it is after the start
            a, b = mine[0]
            if b - s < s - a or s - a > MAX_SHIFT:
                start = mine[1][0] if len(mine) > 1 else s
        if end > e:  # a run crosses the end: ours if most of it is before the end
            a, b = mine[-1]
            if e - a < b - e or b - e > MAX_SHIFT:
                end = mine[-2][1] if len(mine) > 1 else e
        start = max(start, floor)
        if end <= start:
            continue
        seg.start, seg.end = start / FRAMES_PER_SECOND, end / FRAMES_PER_SECOND
        floor = end
