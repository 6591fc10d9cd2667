"""A prompt's ``multi_modal_data`` (vLLM's form) → the encoder input the engine core carries.

Speech models (Whisper) take ``{"audio": (samples, sample_rate)}``: any rate (resampled to 16 kHz),
mono or ``[samples, channels]``, float in [-1, 1] or integer PCM. The front end turns it into the
log-mel features the model's encoder reads (``forwardpass/audio.py``): ``num_mel_bins`` ×
``2 · max_source_positions`` frames, the audio padded with silence or trimmed to that window, as
Whisper does with its 30 s. ``{"input_features": mel}`` passes features made by the caller (the windows of
long-form transcription, ``forwardpass/transcription.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from forwardpass.audio import SAMPLE_RATE, AudioError
from forwardpass.errors import ValidationError
from forwardpass.models.family import family_of
from forwardpass.models.model_spec import ModelSpec


def encoder_input_for(spec: ModelSpec, multi_modal_data: dict[str, Any] | None) -> torch.Tensor | None:
    """Log-mel features for ``spec``'s encoder, or None when no data is given (the core decides
    whether the model needs some)."""
    if multi_modal_data is None:
        return None
    if not isinstance(multi_modal_data, dict):
        raise ValidationError(
            "multi_modal_data must be a dict such as {'audio': (samples, sample_rate)}",
            param="multi_modal_data",
        )
    unknown = sorted(set(multi_modal_data) - {"audio", "input_features"})
    if unknown:
        raise ValidationError(
            f"multi_modal_data: only 'audio' or 'input_features', got {unknown}", param="multi_modal_data"
        )
    family = family_of(spec)  # the model's encoder input, if it has an encoder
    if family.encoder_input_shape is None:
        raise ValidationError(
            f"{spec.name} is a decoder-only model: it takes no audio", param="multi_modal_data"
        )
    if "input_features" in multi_modal_data:  # log-mel features made by the caller (a long-form window); the
        # core checks their shape
        return torch.as_tensor(multi_modal_data["input_features"], dtype=torch.float32)
    audio = multi_modal_data["audio"]
    rate = SAMPLE_RATE
    if isinstance(audio, tuple):
        if len(audio) != 2:
            raise ValidationError("audio must be (samples, sample_rate)", param="multi_modal_data")
        audio, rate = audio
    if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) or not 0 < rate <= 384_000:
        raise ValidationError(
            f"audio sample rate must be an integer in (0, 384000], got {rate!r}", param="multi_modal_data"
        )
    try:
        return family.encoder_input(audio, int(rate))
    except AudioError as exc:
        raise ValidationError(f"audio: {exc}", param="multi_modal_data") from exc
