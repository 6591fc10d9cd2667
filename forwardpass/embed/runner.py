"""``EmbeddingRunner``: an encoder model, its tokenizer and pooling; token ids in, one vector per input out.

An encoder has no decode phase, so there is no scheduler or KV cache: every input is one forward pass of
its own tokens. Inputs are batched by a token budget: sorted by length (so a batch's padding is small),
then cut into forward passes of at most ``max_num_batched_tokens`` padded tokens each (an input longer
than the budget alone still runs, alone). Results come back in the inputs' order.

``max_model_len`` is the smallest of the model's positions (``max_position_embeddings``), the
sentence-transformers ``max_seq_length`` (``sentence_bert_config.json``, which vLLM reads too) and the
caller's ``max_model_len``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from forwardpass.config import resolve_dtype
from forwardpass.embed.inputs import InputLimits
from forwardpass.embed.pooling import PoolingConfig, normalize, pool, read_pooling_config
from forwardpass.errors import ConfigError, UnsupportedArchitectureError
from forwardpass.loader.jsonfile import read_json_object
from forwardpass.loader.paths import model_file
from forwardpass.loader.tokenizer import Tokenizer
from forwardpass.models.model_spec import ModelSpec

logger = logging.getLogger(__name__)

# Padded tokens per forward pass, as the generation engine's default budget. Bigger is not faster on CPU: 256
# MiniLM inputs of 4-62 tokens took 4.9 s at 2048 and 8.4 s at 8192 (one thread; the [tokens, 1536] MLP
# activations of a big pass stop fitting in cache), while one pass runs at HF transformers' speed.
DEFAULT_TOKEN_BUDGET = 2048


def sentence_bert_config(model_dir: Path) -> dict:
    file = model_file(model_dir, "sentence_bert_config.json")
    return (
        read_json_object(file, error=ConfigError, fix="re-save the model with sentence-transformers")
        if file.is_file()
        else {}
    )


class EmbeddingRunner:
    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str | torch.dtype = "auto",
        device: str = "cpu",
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        attention_backend: str = "sdpa",
    ):
        from forwardpass.models.loading import load_model
        from forwardpass.models.registry import is_embedding_architecture

        self.model_dir = Path(model_dir)
        self.device = device
        self.attention_backend = attention_backend
        model, spec = load_model(self.model_dir, resolve_dtype(dtype, device), device)
        if not is_embedding_architecture(spec.architecture):
            raise UnsupportedArchitectureError(
                f"{spec.architecture} is a generative model; embeddings need an encoder (BertModel). "
                "Load it with LLM(model) / forwardpass serve without task='embed'"
            )
        self.model, self.spec = model, spec
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self.pooling: PoolingConfig = read_pooling_config(self.model_dir)
        self.limits = self._limits(spec, max_model_len)
        budget = DEFAULT_TOKEN_BUDGET if max_num_batched_tokens is None else max_num_batched_tokens
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ConfigError(
                f"max_num_batched_tokens must be a positive integer, got {budget!r}",
                param="max_num_batched_tokens",
            )
        self.token_budget = budget
        self._lock = threading.Lock()  # one forward pass at a time: the model's threads are all torch's
        self.forward_passes = 0
        logger.info(
            "embedding model %s: %d dims, pooling %s, max_model_len %d",
            spec.name,
            self.dimensions,
            self.pooling.source,
            self.limits.max_model_len,
        )

    def _limits(self, spec: ModelSpec, requested: int | None) -> InputLimits:
        st = sentence_bert_config(self.model_dir)
        positions = int(spec.max_position_embeddings or 0)
        candidates = [positions]
        if isinstance(st.get("max_seq_length"), int) and st["max_seq_length"] > 0:
            candidates.append(st["max_seq_length"])
        longest = min(candidates)
        if requested is not None:
            if (
                isinstance(requested, bool)
                or not isinstance(requested, int)
                or not 1 <= requested <= positions
            ):
                raise ConfigError(
                    f"max_model_len must be an integer in [1, {positions}] "
                    f"(max_position_embeddings), got {requested!r}",
                    param="max_model_len",
                )
            longest = requested
        return InputLimits(
            max_model_len=longest, vocab_size=spec.vocab, lowercase=bool(st.get("do_lower_case"))
        )

    @property
    def dimensions(self) -> int:
        return self.spec.hidden

    # ----- compute --------------------------------------------------------------------------------
    def plan_batches(self, lengths: Sequence[int]) -> list[list[int]]:
        """Indices of the inputs, grouped into forward passes of at most ``token_budget`` padded tokens."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        batches: list[list[int]] = []
        for i in order:
            # sorted longest first, so a batch's first input sets its padded width
            if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= self.token_budget:
                batches[-1].append(i)
            else:
                batches.append([i])
        return batches

    def embed_ids(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        """One vector per token-id list (already checked by ``embed.inputs``), in the inputs' order."""
        out: list[list[float]] = [[] for _ in inputs]
        for batch in self.plan_batches([len(ids) for ids in inputs]):
            vectors = self._forward([inputs[i] for i in batch])
            for i, vec in zip(batch, vectors):
                out[i] = vec
        return out

    @torch.inference_mode()
    def _forward(self, inputs: list[Sequence[int]]) -> list[list[float]]:
        width = max(len(ids) for ids in inputs)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.full((len(inputs), width), pad, dtype=torch.long)
        mask = torch.zeros((len(inputs), width), dtype=torch.bool)
        for row, seq in enumerate(inputs):
            ids[row, : len(seq)] = torch.tensor(list(seq), dtype=torch.long)
            mask[row, : len(seq)] = True
        ids, mask = ids.to(self.device), mask.to(self.device)
        with self._lock:
            hidden = self.model(ids, mask, backend=self.attention_backend)
            self.forward_passes += 1
        vectors = pool(hidden, mask, self.pooling.mode)
        if self.pooling.normalize:
            vectors = normalize(vectors)
        return vectors.cpu().tolist()
