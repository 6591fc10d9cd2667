"""Whisper (``WhisperForConditionalGeneration``): an audio encoder and a text decoder with cross-attention.

Encoder (once per request, ``encode``): log-mel ``[B, mels, 2·S]`` → two GELU convolutions (the second
with stride 2) → ``[B, S, d]`` plus sinusoidal positions → pre-LayerNorm transformer layers with
bidirectional attention → LayerNorm. Each decoder layer's cross-attention K and V are projected from
that output right away and written into the request's slot (``engine/scheduling/cross_attention_spec.py``);
nothing of the encoder is kept beyond them.

Decoder (every step, ``forward``, on the engine's flattened batch): token embedding + learned
position embedding → N × (LayerNorm, causal self-attention over the paged cache, LayerNorm,
cross-attention over the slot, LayerNorm, GELU MLP), residuals around each → LayerNorm. The LM head is
the token embedding (tied). Parameter names are transformers' so the checkpoint loads by name; k_proj
has no bias, q/v/out projections do (as in transformers). transformers never applies
``scale_embedding`` (its ``embed_scale`` is unused), and neither does this model.

Weights: every attention projection and MLP layer of both stacks is a plan-built ``layers/linear.py::Linear``
and the token embedding a tied ``layers/embedding.py::TokenEmbedding``, so each takes the execution plan's
weight method at construction (fp32, packed fp32, or Q8_0 / Q4_0 blocks quantized once after loading, the
tied LM head Q8_0 in both quantized modes), as the text models do. The convolutions, the position embeddings
and the norms stay fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from forwardpass.attention import attention
from forwardpass.attention.context import AttentionContext
from forwardpass.attention.cross import CachedCrossAttention
from forwardpass.attention.layer import CachedAttention
from forwardpass.errors import ConfigError
from forwardpass.layers.embedding import TokenEmbedding
from forwardpass.layers.linear import Linear
from forwardpass.models.model_spec import ModelSpec
from forwardpass.models.whisper_spec import WhisperSpec

#: A decoder step of at most this many tokens runs its layers on one thread: their ops ([T, d] rows through
#: d x 4d weights, one query row against the encoder's K/V) are too small to split, and waiting at each op's
#: parallel barrier cost more than the work it shared (a 15-token tiny.en transcript: 0.40 s of decoder layers
#: on two threads, 0.21 s on one, same host, same run; more on a loaded one).
ONE_THREAD_TOKENS = 16


class _Projections(nn.Module):
    """q/k/v/out projections under transformers' names (k has no bias)."""

    def __init__(self, d: int):
        super().__init__()
        self.q_proj = Linear(d, d, bias=True)
        self.k_proj = Linear(d, d)
        self.v_proj = Linear(d, d, bias=True)
        self.out_proj = Linear(d, d, bias=True)


class _EncoderLayer(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.self_attn = _Projections(d)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = Linear(d, ffn, bias=True), Linear(ffn, d, bias=True)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, backend: str) -> torch.Tensor:
        b, s, d = x.shape
        h = self.self_attn_layer_norm(x)
        a = self.self_attn

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, d // self.heads).transpose(1, 2)

        out = attention(
            heads(a.q_proj(h)),
            heads(a.k_proj(h)),
            heads(a.v_proj(h)),
            causal=False,
            scale=(d // self.heads) ** -0.5,
            backend=backend,
        )
        x = x + a.out_proj(out.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class WhisperEncoder(nn.Module):
    def __init__(self, spec: ModelSpec, w: WhisperSpec):
        super().__init__()
        d = spec.hidden
        self.frames = w.encoder_input_frames
        self.conv1 = nn.Conv1d(w.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(w.max_source_positions, d)  # sinusoids, stored in the checkpoint
        self.layers = nn.ModuleList(
            _EncoderLayer(d, w.encoder_heads, w.encoder_ffn_dim) for _ in range(w.encoder_layers)
        )
        self.layer_norm = nn.LayerNorm(d)

    def forward(self, features: torch.Tensor, backend: str = "sdpa") -> torch.Tensor:
        if features.shape[-1] != self.frames:
            raise ConfigError(
                f"the encoder reads {self.frames} log-mel frames, got {features.shape[-1]}",
                param="input_features",
            )
        # contiguous once here: a transposed residual stream would be copied by every LayerNorm that reads it
        x = F.gelu(self.conv2(F.gelu(self.conv1(features)))).transpose(1, 2).contiguous()
        x = x + self.embed_positions.weight
        for layer in self.layers:
            x = layer(x, backend)
        return self.layer_norm(x)


class _DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, i: int):
        super().__init__()
        d, self.heads, self.head_dim = spec.hidden, spec.heads, spec.head_dim
        scale = spec.head_dim**-0.5
        self.self_attn = _Projections(d)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = _Projections(d)
        self.encoder_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = Linear(d, spec.intermediate, bias=True)
        self.fc2 = Linear(spec.intermediate, d, bias=True)
        self.final_layer_norm = nn.LayerNorm(d)
        self.attn = CachedAttention(i, scale=scale)
        # cache id: cross_attention_spec.py
        assert spec.whisper is not None
        self.cross = CachedCrossAttention(spec.layers + i, scale=scale,
                                          encoder_len=spec.whisper.max_source_positions)

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        t = x.shape[0]
        a = self.self_attn
        h = self.self_attn_layer_norm(x)
        q, k, v = (p(h).view(t, self.heads, self.head_dim) for p in (a.q_proj, a.k_proj, a.v_proj))
        x = x + a.out_proj(self.attn(q, k, v, ctx).reshape(t, -1))
        c = self.encoder_attn
        q = c.q_proj(self.encoder_attn_layer_norm(x)).view(t, self.heads, self.head_dim)
        x = x + c.out_proj(self.cross(q, ctx).reshape(t, -1))
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class WhisperDecoder(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        assert spec.max_position_embeddings is not None
        self.embed_tokens = TokenEmbedding(spec.vocab, spec.hidden, tied=True)  # also the LM head
        self.embed_positions = nn.Embedding(spec.max_position_embeddings, spec.hidden)
        self.layers = nn.ModuleList(_DecoderLayer(spec, i) for i in range(spec.layers))
        self.layer_norm = nn.LayerNorm(spec.hidden)


class _WhisperModel(nn.Module):
    def __init__(self, spec: ModelSpec, w: WhisperSpec):
        super().__init__()
        self.encoder = WhisperEncoder(spec, w)
        self.decoder = WhisperDecoder(spec)


class WhisperForConditionalGeneration(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        if spec.whisper is None:
            raise ConfigError(
                "WhisperForConditionalGeneration needs a Whisper config (model_type 'whisper')",
                param="model_type",
            )
        self.spec = spec
        self.model = _WhisperModel(spec, spec.whisper)

    @torch.inference_mode()
    def encode(self, features: torch.Tensor, slots: torch.Tensor, kv_caches: list[torch.Tensor]) -> None:
        """Run the encoder over ``features`` ``[B, mels, frames]`` and write every decoder layer's
        cross-attention K/V of request ``b`` into slot ``slots[b]`` of that layer's cache."""
        enc = self.model.encoder(features)
        b, s, _ = enc.shape
        spec = self.spec
        for layer in self.model.decoder.layers:
            c = layer.encoder_attn
            k = c.k_proj(enc).view(b, s, spec.heads, spec.head_dim)
            v = c.v_proj(enc).view(b, s, spec.heads, spec.head_dim)
            cache = kv_caches[layer.cross.cache_id]
            cache[slots] = torch.stack((k, v), dim=1).to(cache.dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        dec = self.model.decoder
        threads = torch.get_num_threads()
        one_thread = input_ids.shape[0] <= ONE_THREAD_TOKENS < threads * ONE_THREAD_TOKENS
        if one_thread:  # see ONE_THREAD_TOKENS; compute_logits (memory-bound) keeps every thread
            torch.set_num_threads(1)
        try:
            x = dec.embed_tokens(input_ids) + dec.embed_positions(positions)
            for layer in dec.layers:
                x = layer(x, ctx)
            return dec.layer_norm(x)
        finally:
            if one_thread:
                torch.set_num_threads(threads)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.decoder.embed_tokens.as_head(hidden)  # proj_out is tied to the embeddings
