"""The speech front end: WAV bytes → mono 16 kHz samples → Whisper's log-mel spectrogram.

``log_mel_spectrogram`` computes what transformers' ``WhisperFeatureExtractor`` computes (and
OpenAI's whisper before it): a 400-point periodic-Hann STFT with hop 160 (10 ms at 16 kHz), centred
with reflect padding, power spectrum through a Slaney-normalised mel filter bank over 0–8 kHz,
``log10`` floored at 1e-10, clamped to 8 decades below the clip's maximum, then ``(x + 4) / 4``. The
waveform is zero-padded or trimmed to ``num_frames * 160`` samples first (3000 frames = 30 s for the
released Whisper models; a model with a smaller ``max_source_positions`` reads ``2 *
max_source_positions`` frames, which ``ModelSpec.encoder_input_frames`` gives).
"""

from __future__ import annotations

import io
import math
import sys
import wave
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

SAMPLE_RATE = 16_000
N_FFT = 400
HOP_LENGTH = 160
WHISPER_FRAMES = 3000  # 30 s
#: audio longer than this (seconds) is resampled by scipy (its import paid once, its C code 10x faster)
LONG_AUDIO_S = 60


class AudioError(ValueError):
    """Audio that cannot be decoded or used (the message names the problem)."""


def _hz_to_mel(freq: np.ndarray) -> np.ndarray:
    # Slaney's scale: linear below 1 kHz, logarithmic above
    f_sp, min_log_hz, min_log_mel, logstep = 200.0 / 3, 1000.0, 15.0, math.log(6.4) / 27.0
    freq = np.asarray(freq, dtype=np.float64)
    mels = freq / f_sp
    high = freq >= min_log_hz
    return np.where(high, min_log_mel + np.log(np.maximum(freq, 1e-10) / min_log_hz) / logstep, mels)


def _mel_to_hz(mels: np.ndarray) -> np.ndarray:
    f_sp, min_log_hz, min_log_mel, logstep = 200.0 / 3, 1000.0, 15.0, math.log(6.4) / 27.0
    mels = np.asarray(mels, dtype=np.float64)
    return np.where(mels >= min_log_mel, min_log_hz * np.exp(logstep * (mels - min_log_mel)), f_sp * mels)


@lru_cache(maxsize=4)
def mel_filters(n_mels: int) -> torch.Tensor:
    """``[n_mels, N_FFT // 2 + 1]`` triangular filters on the Slaney mel scale, area-normalised."""
    fft_freqs = np.linspace(0, SAMPLE_RATE // 2, N_FFT // 2 + 1)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(8000.0), n_mels + 2))
    widths = np.diff(edges)
    slopes = edges[None, :] - fft_freqs[:, None]
    rising = -slopes[:, :-2] / widths[:-1]
    falling = slopes[:, 2:] / widths[1:]
    bank = np.maximum(0.0, np.minimum(rising, falling))  # [freqs, mels]
    bank *= (2.0 / (edges[2 : n_mels + 2] - edges[:n_mels]))[None, :]
    return torch.from_numpy(bank.T.astype(np.float32))


def pad_or_trim(audio: np.ndarray, num_samples: int) -> np.ndarray:
    audio = np.asarray(audio, dtype=np.float32).reshape(-1)
    if audio.shape[0] >= num_samples:
        return audio[:num_samples]
    return np.pad(audio, (0, num_samples - audio.shape[0]))


def log_mel_spectrogram(
    audio: np.ndarray, n_mels: int = 80, num_frames: int = WHISPER_FRAMES
) -> torch.Tensor:
    """``[n_mels, num_frames]`` log-mel features of mono 16 kHz ``audio`` (float samples in [-1, 1]),
    padded with silence or trimmed to ``num_frames`` 10 ms frames."""
    return _log_mel(pad_or_trim(audio, num_frames * HOP_LENGTH), n_mels)


def log_mel_frames(audio: np.ndarray, n_mels: int = 80) -> torch.Tensor:
    """``[n_mels, len(audio) // 160 + 1]`` log-mel features of a whole clip, as faster-whisper computes them
    for long-form transcription: 160 samples of silence appended, the 8-decade floor taken from the whole
    clip's maximum. :func:`mel_window` cuts the encoder's windows out of it."""
    audio = np.asarray(audio, dtype=np.float32).reshape(-1)
    return _log_mel(np.pad(audio, (0, HOP_LENGTH)), n_mels)


def mel_window(
    mel: torch.Tensor, start: int, num_frames: int = WHISPER_FRAMES, silence: bool = False
) -> torch.Tensor:
    """Frames ``start .. start + num_frames`` of ``mel``, padded to ``num_frames``: with zeros
    (faster-whisper's
    ``pad_or_trim`` of the features: the log-mel value 10^-4, not silence), or with ``silence`` with the
    clip's floor, what the frames of appended silent audio are (openai-whisper appends 30 s of it;
    transformers' feature
    extractor pads the audio to the window)."""
    window = mel[:, start : start + num_frames]
    if window.shape[1] < num_frames:
        value = float(mel.max()) - 2.0 if silence else 0.0  # the floor: 8 decades below the clip's loudest
        window = torch.nn.functional.pad(window, (0, num_frames - window.shape[1]), value=value)
    return window.contiguous()


def _log_mel(audio: np.ndarray, n_mels: int) -> torch.Tensor:
    if n_mels not in (80, 128):
        raise AudioError(f"n_mels must be 80 or 128 (Whisper's filter banks), got {n_mels}")
    wave_t = torch.from_numpy(np.ascontiguousarray(audio, dtype=np.float32))
    stft = torch.stft(wave_t, N_FFT, HOP_LENGTH, window=torch.hann_window(N_FFT), return_complex=True)
    power = stft[..., :-1].abs() ** 2  # the STFT gives num_frames + 1 frames; Whisper drops the last
    log_spec = torch.clamp(mel_filters(n_mels) @ power, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


def resample(audio: np.ndarray, sample_rate: int, target_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Polyphase resampling (anti-aliased) from ``sample_rate`` to ``target_rate``."""
    if sample_rate <= 0:
        raise AudioError(f"sample rate must be positive, got {sample_rate}")
    audio = np.asarray(audio, dtype=np.float32)
    if sample_rate == target_rate:
        return audio
    g = math.gcd(int(sample_rate), int(target_rate))
    up, down = target_rate // g, int(sample_rate) // g
    if len(audio) <= LONG_AUDIO_S * sample_rate and "scipy.signal" not in sys.modules:
        # a clip: the same filter in NumPy (forwardpass/resample.py), without scipy.signal's 1-2 s import
        from forwardpass.resample import resample_poly

        return resample_poly(audio, up, down).astype(np.float32)
    from scipy.signal import resample_poly as scipy_resample_poly  # long audio: its C code, 10x faster

    return scipy_resample_poly(audio, up, down).astype(np.float32)


def to_mono_16k(audio: np.ndarray, sample_rate: int) -> np.ndarray:
    """Mono float32 samples at 16 kHz from an array of shape ``[samples]`` or ``[samples, channels]``."""
    audio = np.asarray(audio)
    if audio.ndim == 2:
        audio = audio.mean(axis=1)
    if audio.ndim != 1:
        raise AudioError(
            f"audio must be a 1-D array of samples (or [samples, channels]), got shape {audio.shape}"
        )
    if audio.dtype.kind in "iu":  # integer PCM: scale to [-1, 1]
        info = np.iinfo(audio.dtype)
        audio = (audio.astype(np.float32) - (info.max + info.min + 1) / 2) / (info.max + 1)
    audio = audio.astype(np.float32)
    if not np.all(np.isfinite(audio)):
        raise AudioError("audio contains NaN or infinite samples")
    return resample(audio, int(sample_rate))


def read_wav(source: str | Path | bytes) -> tuple[np.ndarray, int]:
    """``(samples, sample_rate)`` of a WAV file or its bytes: float32 in [-1, 1], channels averaged.

    The standard library reads integer PCM (8/16/24/32-bit); other formats (float WAV, FLAC, OGG) are
    read with ``soundfile`` when it is installed."""
    data = Path(source).read_bytes() if isinstance(source, (str, Path)) else bytes(source)
    try:
        return _read_pcm_wav(data)
    except (wave.Error, EOFError) as exc:
        try:
            import soundfile  # optional: covers float WAV and compressed formats
        except ImportError:
            raise AudioError(
                f"cannot read audio ({exc}); only PCM WAV is supported without soundfile"
            ) from exc
        try:
            samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
        except Exception as sf_exc:  # soundfile raises its own error types
            raise AudioError(f"cannot read audio: {sf_exc}") from sf_exc
        return samples.mean(axis=1).astype(np.float32), int(rate)


def _read_pcm_wav(data: bytes) -> tuple[np.ndarray, int]:
    with wave.open(io.BytesIO(data), "rb") as wav:
        channels, width, rate = wav.getnchannels(), wav.getsampwidth(), wav.getframerate()
        raw = wav.readframes(wav.getnframes())
    if width == 1:  # 8-bit WAV is unsigned
        samples = (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 3:  # 24-bit: widen each little-endian triple to int32
        b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        samples = ((b[:, 0] << 8 | b[:, 1] << 16 | b[:, 2] << 24) >> 8).astype(np.float32) / 2**23
    elif width in (2, 4):
        dtype = np.int16 if width == 2 else np.int32
        samples = np.frombuffer(raw, dtype=f"<{np.dtype(dtype).str[1:]}").astype(np.float32) / float(
            2 ** (8 * width - 1)
        )
    else:
        raise wave.Error(f"unsupported sample width {width} bytes")
    return samples.reshape(-1, channels).mean(axis=1), rate


def duration_seconds(audio: np.ndarray, sample_rate: int) -> float:
    return float(np.asarray(audio).shape[0]) / float(sample_rate)
