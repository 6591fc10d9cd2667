"""The encoder pass of an encoder–decoder model (Whisper), run by the model runner before the decoder.

A request carries its encoder input (log-mel features, ``[num_mel_bins, frames]``) from the front end
through ``Sequence`` and ``NewSequence`` to the runner's mirror. When a request's first chunk is in
the step (position 0: a new request, or one recomputed after preemption), its features go through
the encoder, batched with every other request starting in the same step, and the model writes each
decoder layer's cross-attention K/V into the request's slot (``CrossAttentionSpec``). Later chunks
and decode steps only read the slot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, cast

import torch

from forwardpass.engine.scheduling.batch import ScheduledChunk
from forwardpass.engine.scheduling.cross_attention_spec import CrossAttentionSpec
from forwardpass.engine.scheduling.kv_cache_spec import KVCacheGroup
from forwardpass.errors import ValidationError
from forwardpass.models.family import family_of
from forwardpass.models.model_spec import ModelSpec


class EncoderDecoderModel(Protocol):
    def encode(self, features: torch.Tensor, slots: torch.Tensor, kv_caches: list[torch.Tensor]) -> None:
        """Encode ``features`` ``[B, mels, frames]``; write request ``b``'s cross K/V
        into slot ``slots[b]``."""


class _EncoderSequence(Protocol):
    encoder_input: torch.Tensor | None
    block_tables: list[list[int]]


def check_encoder_input(spec: ModelSpec, encoder_input: torch.Tensor | None) -> None:
    """An encoder–decoder model needs features of its encoder's shape; a decoder-only model none."""
    want = family_of(spec).encoder_input_shape
    if want is None:
        if encoder_input is not None:
            raise ValidationError(
                f"{spec.name} is a decoder-only model: it takes no audio (multi_modal_data)",
                param="multi_modal_data",
            )
        return
    if encoder_input is None:
        raise ValidationError(
            f"{spec.name} transcribes audio: pass multi_modal_data={{'audio': (samples, rate)}}",
            param="multi_modal_data",
        )
    if tuple(encoder_input.shape) != want:
        raise ValidationError(
            f"encoder input must be log-mel features of shape {list(want)}, got {list(encoder_input.shape)}",
            param="multi_modal_data",
        )


def run_encoders(
    model: object,  # an EncoderDecoderModel whenever a cross-attention group exists
    chunks: Sequence[ScheduledChunk],
    sequences: Mapping[int, _EncoderSequence],
    groups: Sequence[KVCacheGroup],
    kv_caches: list[torch.Tensor],
    dtype: torch.dtype,
) -> int:
    """Run the encoder for the requests whose first chunk is in this step; return how many."""
    cross = [g for g, group in enumerate(groups) if isinstance(group.spec, CrossAttentionSpec)]
    if not cross:
        return 0
    starting = [sequences[c.seq_id] for c in chunks if c.num_computed_tokens == 0]
    if not starting:
        return 0
    if any(s.encoder_input is None for s in starting):
        raise ValidationError(
            "a request reached the encoder without its encoder input", param="multi_modal_data"
        )
    device = kv_caches[groups[cross[0]].layer_ids[0]].device
    features = torch.stack([s.encoder_input for s in starting if s.encoder_input is not None]).to(
        device, dtype
    )
    slots = torch.tensor([s.block_tables[cross[0]][0] for s in starting], dtype=torch.long, device=device)
    cast(EncoderDecoderModel, model).encode(features, slots, kv_caches)
    return len(starting)
