"""BERT, the encoder: embeddings → N × (bidirectional attention, post-LayerNorm, GELU MLP, post-LayerNorm).

An encoder reads the whole input at once and every token attends to every other one (no causal mask,
no KV cache: nothing is generated). A batch is right-padded to its longest sequence; the padding mask
keeps real tokens from attending to pad positions, through the same ``forwardpass.attention`` interface
the decoders use (``causal=False`` plus ``key_padding_mask``). Pad rows still get (meaningless) hidden
states; pooling (``forwardpass/embed/pooling.py``) ignores them.

Parameters keep Hugging Face's names (``encoder.layer.N.attention.self.query``...), so the checkpoint
loads name for name; a ``bert.`` prefix (checkpoints saved from ``BertFor*`` heads) is accepted too.
The pooler (dense + tanh over [CLS], trained for next-sentence prediction) is not built: sentence
embeddings are pooled from the last hidden states, as sentence-transformers and vLLM do.
"""

from __future__ import annotations

import torch
from torch import nn

from forwardpass.attention import attention
from forwardpass.errors import UnsupportedArchitectureError, ValidationError
from forwardpass.layers.activation import get_activation
from forwardpass.loader.weights import WeightSource, load_into
from forwardpass.models.bert_spec import BertSpec
from forwardpass.models.model_spec import ModelSpec


class BertEmbeddings(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        assert spec.max_position_embeddings is not None  # ModelSpec refuses a BERT config without it
        self.word_embeddings = nn.Embedding(spec.vocab, spec.hidden)
        self.position_embeddings = nn.Embedding(spec.max_position_embeddings, spec.hidden)
        types = BertSpec.of(spec).type_vocab_size
        self.token_type_embeddings = nn.Embedding(types, spec.hidden) if types else None
        self.LayerNorm = nn.LayerNorm(spec.hidden, eps=spec.norm.eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        positions = torch.arange(
            input_ids.shape[1], device=input_ids.device
        )  # right padding: 0.. for every row
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)[None]
        if self.token_type_embeddings is not None:
            # One segment (type 0) unless told otherwise, as HF's BertModel defaults token_type_ids to zeros.
            types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
            x = x + self.token_type_embeddings(types)
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.heads, self.head_dim = spec.heads, spec.head_dim
        self.query = nn.Linear(spec.hidden, spec.q_dim)
        self.key = nn.Linear(spec.hidden, spec.q_dim)
        self.value = nn.Linear(spec.hidden, spec.q_dim)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None, backend: str) -> torch.Tensor:
        b, n, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # [B, N, H*D] -> [B, H, N, D]
            return t.view(b, n, self.heads, self.head_dim).transpose(1, 2)

        out = attention(
            heads(self.query(x)),
            heads(self.key(x)),
            heads(self.value(x)),
            causal=False,
            scale=self.head_dim**-0.5,
            key_padding_mask=key_padding_mask,
            backend=backend,
        )
        return out.transpose(1, 2).reshape(b, n, self.heads * self.head_dim)


class BertSelfOutput(nn.Module):
    """Projection, residual, then LayerNorm (BERT normalises after the residual add, not before)."""

    def __init__(self, d_in: int, hidden: int, eps: float):
        super().__init__()
        self.dense = nn.Linear(d_in, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.self = BertSelfAttention(spec)
        self.output = BertSelfOutput(spec.q_dim, spec.hidden, spec.norm.eps)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None, backend: str) -> torch.Tensor:
        return self.output(self.self(x, key_padding_mask, backend), x)


class BertIntermediate(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.dense = nn.Linear(spec.hidden, spec.intermediate)
        self.act = get_activation(spec.hidden_act)  # "gelu": the exact (erf) GELU, as HF's BERT

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.attention = BertAttention(spec)
        self.intermediate = BertIntermediate(spec)
        self.output = BertSelfOutput(spec.intermediate, spec.hidden, spec.norm.eps)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None, backend: str) -> torch.Tensor:
        h = self.attention(x, key_padding_mask, backend)
        return self.output(self.intermediate(h), h)


class BertEncoder(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(spec) for _ in range(spec.layers))


class BertModel(nn.Module):
    """``forward(input_ids [B, N], attention_mask [B, N]) -> last hidden states [B, N, hidden]``."""

    #: an encoder: ``LLM(model, task="embed")`` runs it, the generation engine refuses it
    is_encoder = True

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.max_positions = int(spec.max_position_embeddings or 0)
        self.embeddings = BertEmbeddings(spec)
        self.encoder = BertEncoder(spec)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        *,
        backend: str = "sdpa",
    ) -> torch.Tensor:
        if input_ids.dim() != 2:  # the generation engine's flattened [T] batch: this model cannot generate
            raise UnsupportedArchitectureError(
                "BertModel is an encoder: it embeds text and cannot generate; load it with LLM(model, "
                "task='embed') or forwardpass serve --task embed"
            )
        if input_ids.shape[1] > self.max_positions:
            raise ValidationError(
                f"{input_ids.shape[1]} tokens exceed the model's {self.max_positions} positions "
                "(max_position_embeddings)",
                param="input",
            )
        # An all-real batch needs no mask: the fused kernels then skip masking entirely.
        mask = None if attention_mask is None or bool(attention_mask.all()) else attention_mask.bool()
        x = self.embeddings(input_ids, token_type_ids)
        for layer in self.encoder.layer:
            x = layer(x, mask, backend)
        return x

    def load_weights(self, source: WeightSource) -> None:
        """HF names as they are, or under ``bert.`` (a checkpoint saved from ``BertForMaskedLM`` etc.)."""
        prefix = "bert." if "bert.embeddings.word_embeddings.weight" in source else ""
        for name, param in self.named_parameters():
            load_into(param, source, prefix + name)
