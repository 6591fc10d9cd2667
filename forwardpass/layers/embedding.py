"""Token embeddings, whose matrix is also the LM head where the model ties the two.

A tied matrix is multiplied by every step's hidden states (a quarter of a 0.6B model's weights), so it takes
the plan's LM-head weight method (layers/weight_methods.py): quantized to 8 bits when the plan quantizes, or
packed for oneDNN and the small-batch kernel. A lookup then gathers just the rows it reads from whatever holds
the matrix (dequantizing those rows, or reading them across the packed panels). An untied embedding stays
fp32: a lookup reads a few rows per token, so it costs memory, not time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from forwardpass.layers.weight_methods import Fp32Method, method_for
from forwardpass.plan import current_plan


class TokenEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, tied: bool = False):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        #: the LM head's method where the head is this matrix (None: a plain lookup table)
        self.head_method: Fp32Method | None = method_for(current_plan(), "lm_head") if tied else None

    def process_weights_after_loading(self) -> None:
        if self.head_method is not None:
            self.head_method.process_weights_after_loading(self)

    def as_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``hidden · Eᵀ`` through the LM head's method (a tied embedding only)."""
        if self.head_method is None:
            raise RuntimeError("this embedding is not tied to the LM head")
        return self.head_method.apply(self, hidden, None)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, torch.Tensor):
            return F.embedding(ids, self.weight)
        return self.weight.rows(ids)  # a quantized or packed matrix: just the rows read

    def extra_repr(self) -> str:
        tied = ", tied to the LM head" if self.head_method else ""
        return f"{self.num_embeddings}, {self.embedding_dim}" + tied
