"""The shell every decoder family fills: embedding → N × layer → final norm → LM head.

A family supplies its layer class (``layer(spec, i)``) and, where it differs, its norm, its rotary embedding
and the few hooks below; the shell supplies the rest, once:

* :class:`DecoderModel`: the token embedding (vocabulary-parallel under tensor parallelism, the LM head's
  matrix where tied), the layers, the final norm and the rotary table computed once per forward and shared by
  every layer; the decode stack (``models/llama_decode_stack.py``) where one was built over the layers. Hooks:
  :meth:`embed` (Gemma's normalizer, DeepSeek-V4's residual streams), :meth:`run_layers` (Gemma's local
  rotary, DeepSeek-V4's per-layer arguments), :meth:`finish` (DeepSeek-V4's stream collapse before its norm).
* :class:`CausalLM`: the decoder under ``model`` (``decoder_attribute``), the LM head (none where tied, then
  the embedding's matrix is the head; a vocabulary slice per rank under tensor parallelism),
  :meth:`compute_logits` through the head's weight method, and :meth:`load_weights` by checkpoint name: merged
  modules through ``packed_modules`` and other names through the public ``checkpoint_renames`` map. A family
  whose parameters need more than a name (stacked experts: ``models/moe_loading.py``) overrides
  :meth:`load_parameter`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from forwardpass.attention.context import AttentionContext
from forwardpass.layers.embedding import TokenEmbedding
from forwardpass.layers.linear import Linear
from forwardpass.layers.norm import RMSNorm
from forwardpass.layers.parallel_linear import VocabParallelEmbedding
from forwardpass.loader.weights import WeightSource, checkpoint_names, load_into
from forwardpass.models.model_spec import ModelSpec
from forwardpass.plan import current_plan

#: ``layer(spec, layer_idx)``: a family's decoder layer class (or any callable making one)
LayerFactory = Callable[[ModelSpec, int], nn.Module]
#: ``norm(hidden, eps)``: the final norm's class
NormFactory = Callable[[int, float], nn.Module]


def token_embedding(spec: ModelSpec) -> nn.Module:
    """The token embedding: this rank's vocabulary rows under tensor parallelism, else the whole matrix (which
    takes the LM head's weight method where the model ties the two)."""
    tp = current_plan().tensor_parallel
    if tp.enabled:
        return VocabParallelEmbedding(spec.vocab, spec.hidden, tp)
    return TokenEmbedding(spec.vocab, spec.hidden, tied=spec.tied)


class DecoderModel(nn.Module):
    """``embed_tokens`` → ``layers`` → ``norm``; each layer is called as ``layer(x, cos, sin, ctx)``
    (``layer(x, ctx)`` without a rotary embedding: Mamba2) and returns the new hidden states."""

    #: every layer of a pure decode step in one C++ call (models/llama_decode_stack.py), built after loading
    #: where the plan has it and the layers are exactly what it computes; None: the modules
    decode_stack: Any = None

    def __init__(
        self,
        spec: ModelSpec,
        layer: LayerFactory,
        *,
        norm: NormFactory = RMSNorm,
        rotary: nn.Module | None = None,
        embedding: nn.Module | None = None,
    ):
        super().__init__()
        self.embed_tokens = embedding if embedding is not None else token_embedding(spec)
        self.layers = nn.ModuleList(layer(spec, i) for i in range(spec.layers))
        self.norm = norm(spec.hidden, spec.norm.eps)
        self.rotary = rotary  # None: no positions (the state carries the order)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def run_layers(
        self, x: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext | None
    ) -> torch.Tensor:
        rope = () if self.rotary is None else self.rotary.cos_sin(positions, x.dtype)  # once, for every layer
        if self.decode_stack is not None and self.decode_stack.applies(x, rope[0], ctx):
            return self.decode_stack(x, *rope, ctx)  # the same kernels without the Python between them
        for layer in self.layers:
            x = layer(x, *rope, ctx)
        return x

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext | None):
        return self.finish(self.run_layers(self.embed(input_ids), input_ids, positions, ctx))


class CausalLM(nn.Module):
    """A decoder and its LM head. Subclasses build the decoder in :meth:`build_decoder`."""

    #: merged module → the checkpoint modules stored side by side in it (see MergedLinear)
    packed_modules: ClassVar[dict[str, list[str]]] = {}
    #: our parameter-name prefix → the checkpoint's, where the two differ (whole dotted components)
    checkpoint_renames: ClassVar[dict[str, str]] = {}
    #: the attribute the decoder lives under (its name in checkpoints and LoRA adapters)
    decoder_attribute: ClassVar[str] = "model"

    def __init__(self, spec: ModelSpec, *, tied: bool | None = None):
        super().__init__()
        self.spec = spec
        self.add_module(self.decoder_attribute, self.build_decoder(spec))
        self.tie_word_embeddings = spec.tied if tied is None else tied
        tp = current_plan().tensor_parallel
        self.vocab_parallel = tp.enabled  # logits gathered from every rank's vocabulary slice
        if self.tie_word_embeddings:
            self.lm_head = None  # logits use the embedding matrix itself: one copy in memory
        elif self.vocab_parallel:
            self.lm_head = VocabParallelEmbedding(spec.vocab, spec.hidden, tp)
        else:
            self.lm_head = Linear(spec.hidden, spec.vocab, role="lm_head")

    def build_decoder(self, spec: ModelSpec) -> nn.Module:
        raise NotImplementedError

    @property
    def decoder(self) -> DecoderModel:
        return getattr(self, self.decoder_attribute)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext | None = None):
        """Hidden states ``[T, hidden]`` of every input row (logits are computed only where needed)."""
        return self.decoder(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.vocab_parallel:
            return (self.decoder.embed_tokens if self.lm_head is None else self.lm_head).logits(hidden)
        return self.head_logits(hidden)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden · headᵀ`` through the head's weight method (the tied embedding's or the LM head's own)."""
        head = self.decoder.embed_tokens.as_head(hidden) if self.lm_head is None else self.lm_head(hidden)
        return head.float()

    # ----- loading ------------------------------------------------------------------------------------------
    def checkpoint_name(self, name: str) -> str:
        """The checkpoint's name for our (module or parameter) name ``name`` (``checkpoint_renames``)."""
        for ours, theirs in self.checkpoint_renames.items():
            if name == ours or name.startswith(ours + "."):
                return theirs + name[len(ours) :]
        return name

    def checkpoint_names(self, name: str) -> list[tuple[str, tuple[int, int] | None]]:
        """The checkpoint tensors feeding parameter ``name``: ``[(name, None)]``, or one
        ``(name, (start, end))`` per projection stored side by side in a merged parameter
        (``packed_modules``)."""
        return [(self.checkpoint_name(ckpt), span) for ckpt, span in checkpoint_names(self, name)]

    def load_parameter(self, name: str, param: torch.Tensor, source: WeightSource) -> None:
        for ckpt, span in self.checkpoint_names(name):
            load_into(param if span is None else param[span[0] : span[1]], source, ckpt)

    def load_weights(self, source: WeightSource) -> None:
        """Every parameter from the checkpoint, tensor by tensor (``models/loading.py`` calls this)."""
        for name, param in self.named_parameters():
            self.load_parameter(name, param, source)
