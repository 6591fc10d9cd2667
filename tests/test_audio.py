"""The speech front end: log-mel features equal transformers' WhisperFeatureExtractor (80 and 128 mels,
the 30 s window and a shorter one, clips shorter and longer than it), WAV decoding of every PCM width and
of stereo, resampling that keeps a tone's pitch, and errors for unusable audio."""

from __future__ import annotations

import io
import math
import wave

import numpy as np
import pytest

from forwardpass.audio import AudioError, log_mel_spectrogram, read_wav, resample, to_mono_16k

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("n_mels", [80, 128])
@pytest.mark.parametrize("seconds", [30, 6])
def test_log_mel_equals_whisper_feature_extractor(n_mels, seconds):
    fe = transformers.WhisperFeatureExtractor(feature_size=n_mels, chunk_length=seconds)
    rng = np.random.default_rng(n_mels + seconds)
    t = np.arange(16_000 * 3) / 16_000
    tone = (0.3 * np.sin(2 * np.pi * 440 * t) * np.exp(-t)).astype(np.float32)
    clips = [
        tone,
        (0.1 * rng.standard_normal(123)).astype(np.float32),  # a chirp-like tone; a tiny clip
        (0.2 * rng.standard_normal(16_000 * (seconds + 5))).astype(np.float32),
    ]  # longer than the window
    for clip in clips:
        want = fe(clip, sampling_rate=16_000, return_tensors="np").input_features[0]
        got = log_mel_spectrogram(clip, n_mels, seconds * 100)
        assert tuple(got.shape) == (n_mels, seconds * 100) == want.shape
        np.testing.assert_allclose(got.numpy(), want, atol=1e-3, rtol=0)


def test_default_shape_is_whisper_30s_window():
    assert tuple(log_mel_spectrogram(np.zeros(16_000, np.float32)).shape) == (80, 3000)
    with pytest.raises(AudioError, match="n_mels"):
        log_mel_spectrogram(np.zeros(10, np.float32), n_mels=64)


def _wav(samples: np.ndarray, rate: int, width: int, channels: int = 1) -> bytes:
    if width == 1:
        raw = (np.round(samples * 127) + 128).astype(np.uint8).tobytes()
    elif width == 3:
        ints = np.round(samples * (2**23 - 1)).astype("<i4")
        raw = b"".join(int(v).to_bytes(4, "little", signed=True)[:3] for v in ints)
    else:
        dtype = "<i2" if width == 2 else "<i4"
        raw = np.round(samples * (2 ** (8 * width - 1) - 1)).astype(dtype).tobytes()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)
    return buf.getvalue()


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_read_wav_every_pcm_width(width):
    samples = np.sin(np.linspace(0, 20, 800)).astype(np.float32) * 0.5
    got, rate = read_wav(_wav(samples, 8_000, width))
    assert rate == 8_000 and got.dtype == np.float32
    np.testing.assert_allclose(got, samples, atol=2.0 / 127 if width == 1 else 1e-4)


def test_read_wav_stereo_is_averaged(tmp_path):
    left, right = np.full(100, 0.5, np.float32), np.full(100, -0.25, np.float32)
    inter = np.stack([left, right], axis=1).reshape(-1)
    path = tmp_path / "stereo.wav"
    path.write_bytes(_wav(inter, 16_000, 2, channels=2))
    got, _ = read_wav(path)
    np.testing.assert_allclose(got, 0.125, atol=1e-4)


def test_read_wav_refuses_garbage():
    with pytest.raises(AudioError):
        read_wav(b"RIFF....not really a wave file")


@pytest.mark.parametrize("rate", [8_000, 22_050, 44_100, 48_000])
def test_resampling_keeps_the_pitch(rate):
    t = np.arange(rate) / rate  # one second
    out = resample(np.sin(2 * np.pi * 1000 * t).astype(np.float32), rate)
    assert abs(len(out) - 16_000) <= 1
    spectrum = np.abs(np.fft.rfft(out))
    assert abs(np.argmax(spectrum) * 16_000 / len(out) - 1000) < 2


def test_to_mono_16k_scales_integer_pcm_and_refuses_bad_audio():
    pcm = np.array([0, 16384, -32768], dtype=np.int16)
    np.testing.assert_allclose(to_mono_16k(pcm, 16_000), [0.0, 0.5, -1.0])
    with pytest.raises(AudioError, match="NaN"):
        to_mono_16k(np.array([0.0, np.inf]), 16_000)
    with pytest.raises(AudioError, match="1-D"):
        to_mono_16k(np.zeros((2, 2, 2)), 16_000)
    with pytest.raises(AudioError, match="positive"):
        to_mono_16k(np.zeros(4), 0)


@pytest.mark.parametrize("rate", [8_000, 22_050, 44_100, 48_000])
def test_numpy_resampling_is_scipys(rate):
    """forwardpass/resample.py (what a clip takes, without scipy.signal's import) against scipy itself."""
    from scipy.signal import resample_poly as scipy_resample_poly

    from forwardpass.resample import resample_poly

    x = np.random.default_rng(rate).standard_normal(rate + 17)
    g = math.gcd(16_000, rate)
    np.testing.assert_allclose(resample_poly(x, 16_000 // g, rate // g),
                               scipy_resample_poly(x, 16_000 // g, rate // g), atol=1e-9)
    assert len(resample_poly(x[:5], 16_000 // g, rate // g)) == len(scipy_resample_poly(x[:5], 16_000 // g,
                                                                                         rate // g))
