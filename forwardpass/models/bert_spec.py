"""The spec of BERT-style encoders (``models/bert.py``): learned absolute positions
only, segment embeddings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from forwardpass.errors import ConfigError
from forwardpass.models.family import ModelFamily
from forwardpass.models.model_spec import ModelSpec, decoder_spec


@dataclass(frozen=True)
class BertSpec(ModelFamily):
    """A BERT encoder's own sizes; its parameter and byte terms are the ordinary decoder's (the segment
    table is not counted, as before)."""

    type_vocab_size: int = 0  # segment (token type) embeddings (BERT: 2); 0 = none

    @staticmethod
    def of(spec: ModelSpec) -> BertSpec:
        """The spec's BERT sizes (the defaults for a spec built by hand without them)."""
        return spec.family if isinstance(spec.family, BertSpec) else BertSpec()


def bert_spec(cfg: Mapping[str, Any], name: str) -> ModelSpec:
    """The segment-embedding count, and only learned absolute positions (the ``relative_key*`` variants add a
    distance embedding to the attention scores, which is not built); the rest (``layer_norm_eps`` as the
    norm's epsilon) from the common core."""
    kind = cfg.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ConfigError(f"position_embedding_type {kind!r} is not supported; only 'absolute' BERT models "
                          "are", param="position_embedding_type")
    if not cfg.get("max_position_embeddings"):
        raise ConfigError("a BERT config needs max_position_embeddings (its learned position table)",
                          param="max_position_embeddings")
    return decoder_spec(cfg, name, family=BertSpec(type_vocab_size=int(cfg.get("type_vocab_size") or 0)))
