"""The spec of Whisper (``models/whisper.py``): ``WhisperSpec`` (the audio encoder) and the derivation that
reads its keys (``d_model``, ``decoder_layers``, ``encoder_layers``, ``num_mel_bins``, ...: none of the
decoder names)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from forwardpass.errors import ConfigError
from forwardpass.loader.config import eos_token_ids
from forwardpass.models.family import ModelFamily
from forwardpass.models.model_spec import Biases, ModelSpec, NormSpec

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class WhisperSpec(ModelFamily):
    """Whisper's audio encoder (``_whisper_spec``); the ModelSpec's own sizes describe its decoder.

    The encoder reads ``2 * max_source_positions`` log-mel frames (two convolutions, the second with
    stride 2), so its output, and every request's cross-attention K/V, has ``max_source_positions``
    positions: 1500 (30 s of audio) for the released checkpoints, fewer for a smaller config. As the
    family (``models/family.py``) it gives the front end its encoder input: log-mel features."""

    spec_attribute: ClassVar[str] = "whisper"  # read as ``spec.whisper`` by the family's model

    num_mel_bins: int
    encoder_layers: int
    encoder_heads: int
    encoder_ffn_dim: int
    max_source_positions: int
    decoder_start_token_id: int

    @property
    def encoder_input_frames(self) -> int:
        """10 ms log-mel frames the encoder reads (the audio is padded or trimmed to this)."""
        return 2 * self.max_source_positions

    @property
    def encoder_seconds(self) -> float:
        return self.encoder_input_frames / 100.0

    @property
    def encoder_input_shape(self) -> tuple[int, ...] | None:
        return (self.num_mel_bins, self.encoder_input_frames)

    def encoder_input(self, audio: Any, rate: int) -> torch.Tensor:
        """Log-mel features of ``audio`` (any rate, resampled to 16 kHz; mono or ``[samples, channels]``),
        padded with silence or trimmed to the encoder's window (``forwardpass/audio.py``)."""
        import numpy as np

        from forwardpass.audio import log_mel_spectrogram, to_mono_16k

        # only the encoder's window is heard: trim before resampling (plus a second for the filter's edge)
        window = int((self.encoder_seconds + 1) * int(rate))
        samples = to_mono_16k(np.asarray(audio)[:window], int(rate))
        return log_mel_spectrogram(samples, self.num_mel_bins, self.encoder_input_frames)


def whisper_spec(cfg: Mapping[str, Any], name: str) -> ModelSpec:
    """Whisper: the decoder as the spec's layers (pre-LayerNorm, GELU MLP, learned positions, q/v/o
    biases, the LM head tied to the token embeddings), the encoder as ``WhisperSpec``."""

    def need(key: str) -> int:
        value = cfg.get(key)
        if value is None:
            raise ConfigError(f"a Whisper config needs {key!r}", param=key)
        return int(value)

    hidden = need("d_model")
    heads, enc_heads = need("decoder_attention_heads"), need("encoder_attention_heads")
    for key, h in (("decoder_attention_heads", heads), ("encoder_attention_heads", enc_heads)):
        if hidden % h:
            raise ConfigError(f"d_model={hidden} is not a multiple of {key}={h}", param=key)
    # scale_embedding is ignored, as transformers' WhisperDecoder ignores it (its embed_scale is never
    # applied)
    if need("num_mel_bins") not in (80, 128):
        raise ConfigError(
            f"num_mel_bins must be 80 or 128 (Whisper's log-mel filter banks), got {cfg['num_mel_bins']}",
            param="num_mel_bins",
        )
    act = str(cfg.get("activation_function") or "gelu")
    if act != "gelu":
        raise ConfigError(
            f"Whisper activation_function {act!r} is not supported (only 'gelu')", param="activation_function"
        )
    archs = cfg.get("architectures") or ["WhisperForConditionalGeneration"]
    return ModelSpec(
        name=name or str(cfg.get("_name_or_path") or archs[0]),
        architecture=str(archs[0]),
        hidden=hidden,
        layers=need("decoder_layers"),
        heads=heads,
        kv_heads=heads,
        head_dim=hidden // heads,
        intermediate=need("decoder_ffn_dim"),
        vocab=need("vocab_size"),
        tied=True,
        biases=Biases(qkv=True, o=True, mlp=True),  # q and v have biases, k has none (the model knows)
        hidden_act="gelu",
        norm=NormSpec(eps=1e-5),  # torch LayerNorm's default, which Whisper uses
        max_position_embeddings=need("max_target_positions"),
        eos_token_ids=eos_token_ids(cfg),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "") or None,
        family=WhisperSpec(
            num_mel_bins=need("num_mel_bins"),
            encoder_layers=need("encoder_layers"),
            encoder_heads=enc_heads,
            encoder_ffn_dim=need("encoder_ffn_dim"),
            max_source_positions=need("max_source_positions"),
            decoder_start_token_id=need("decoder_start_token_id"),
        ),
    )
