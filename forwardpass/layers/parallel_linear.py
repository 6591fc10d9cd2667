"""Megatron-style tensor-parallel layers: each rank holds a slice of every weight.

A transformer block needs one all-reduce per sub-layer when its two matmuls are split in turn:

* **column-parallel** (``ColumnParallelLinear``: q/k/v, gate/up): each rank computes a slice of the
  output features from the full input, no communication. Attention heads and MLP channels are
  independent, so everything between the two matmuls (RoPE, attention, SiLU·up) stays local.
* **row-parallel** (``RowParallelLinear``: o_proj, down_proj): each rank multiplies its slice of the
  input features by the matching columns of the weight, giving a partial sum of the full output;
  one all-reduce adds the partials. The bias is added once, after the sum.
* **vocab-parallel** embedding and LM head: each rank owns ``ceil(V / N)`` rows of the vocabulary. The
  embedding looks up the ids it owns (zeros for the others) and all-reduces; the LM head computes its
  slice of the logits and gathers them on rank 0, which samples.

KV heads: with ``N <= num_key_value_heads`` each rank gets ``kv_heads / N`` of them; with more ranks
than KV heads each KV head is replicated on ``N / kv_heads`` ranks (rank ``r`` uses head
``r // (N / kv_heads)``), which keeps every query head next to the KV head it attends to.

Every sharded parameter says where its rows come from in the checkpoint (:class:`Shard`), so the
loader (``models/parallel_loading.py``) reads only those rows or columns from the safetensors file.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from forwardpass.errors import ConfigError
from forwardpass.layers.activation import get_activation, silu_and_mul
from forwardpass.layers.dense_matmul import dense_matmul
from forwardpass.parallel_state import TensorParallel


@dataclass(frozen=True)
class Shard:
    """Local rows ``rows`` (dim 0) of a parameter come from checkpoint tensor ``<module>.<param>`` where the
    module is ``checkpoint`` (None: this module's own name), sliced to ``span`` along ``dim``."""

    checkpoint: str | None
    rows: tuple[int, int]
    dim: int
    span: tuple[int, int]


def even_split(total: int, tp: TensorParallel, what: str) -> tuple[int, int]:
    """This rank's ``[start, end)`` of ``total`` items split evenly (an error naming them if it can't be)."""
    if total % tp.size:
        raise ConfigError(
            f"tensor_parallel_size={tp.size} must divide {what} ({total})", param="tensor_parallel_size"
        )
    n = total // tp.size
    return tp.rank * n, (tp.rank + 1) * n


class ColumnParallelLinear(nn.Module):
    """Several projections of one input, each contributing the slice ``parts[name]`` of its output
    features on this rank, stored side by side as one weight (one matmul)."""

    def __init__(self, in_features: int, parts: dict[str, tuple[int, int]], bias: bool = False):
        super().__init__()
        self.parts = dict(parts)
        self.output_sizes = {name: end - start for name, (start, end) in parts.items()}
        out = sum(self.output_sizes.values())
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_matmul(x, self.weight, self.bias)

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        return list(out.split(list(self.output_sizes.values()), dim=-1))

    def shards(self, param: str) -> list[Shard]:
        out, start = [], 0
        for name, span in self.parts.items():
            size = span[1] - span[0]
            out.append(Shard(name, (start, start + size), 0, span))
            start += size
        return out


class RowParallelLinear(nn.Module):
    """``in_features`` split across ranks; the partial outputs are summed with one all-reduce."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TensorParallel,
        bias: bool = False,
        what: str = "the input features",
    ):
        super().__init__()
        self.tp = tp
        self.span = even_split(in_features, tp, what)
        self.out_features = out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, self.span[1] - self.span[0]), requires_grad=False
        )
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(dense_matmul(x, self.weight))
        return out if self.bias is None else out + self.bias

    def shards(self, param: str) -> list[Shard]:
        if param == "bias":  # replicated: added once, after the sum
            return [Shard(None, (0, self.out_features), 0, (0, self.out_features))]
        return [Shard(None, (0, self.out_features), 1, self.span)]


def qkv_parallel(
    hidden: int, heads: int, kv_heads: int, head_dim: int, tp: TensorParallel, bias: bool = False
) -> tuple[ColumnParallelLinear, int, int]:
    """The merged q/k/v projection of this rank and its ``(local query heads, local KV heads)``."""
    q0, q1 = even_split(heads, tp, "the attention heads")
    if kv_heads >= tp.size:
        k0, k1 = even_split(kv_heads, tp, "the KV heads")
    elif tp.size % kv_heads == 0:  # more ranks than KV heads: each KV head lives on size/kv_heads ranks
        k0 = tp.rank // (tp.size // kv_heads)
        k1 = k0 + 1
    else:
        raise ConfigError(
            f"tensor_parallel_size={tp.size} must divide or be a multiple of num_key_value_heads "
            f"({kv_heads})",
            param="tensor_parallel_size",
        )
    d = head_dim
    parts = {"q_proj": (q0 * d, q1 * d), "k_proj": (k0 * d, k1 * d), "v_proj": (k0 * d, k1 * d)}
    return ColumnParallelLinear(hidden, parts, bias=bias), q1 - q0, k1 - k0


class ParallelGatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate/up column-split and down row-split: one all-reduce."""

    def __init__(
        self, hidden: int, intermediate: int, hidden_act: str, tp: TensorParallel, bias: bool = False
    ):
        super().__init__()
        span = even_split(intermediate, tp, "the MLP width")
        self.gate_up_proj = ColumnParallelLinear(hidden, {"gate_proj": span, "up_proj": span}, bias=bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, tp, bias=bias, what="the MLP width")
        self.act = get_activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.act))


class VocabParallelEmbedding(nn.Module):
    """This rank's ``ceil(V / N)`` rows of the embedding (the last rank's tail padded with zeros).

    Also the LM head's weight (its own copy when the embeddings are untied): :meth:`logits` computes
    this rank's slice of the vocabulary's logits and gathers all of them on rank 0.
    """

    def __init__(self, vocab: int, hidden: int, tp: TensorParallel):
        super().__init__()
        self.tp, self.vocab = tp, vocab
        self.per_rank = -(-vocab // tp.size)
        self.start = min(vocab, tp.rank * self.per_rank)
        self.end = min(vocab, self.start + self.per_rank)
        # zeros: the padding rows must embed to 0 and give logits that are cut off anyway
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mine = (input_ids >= self.start) & (input_ids < self.end)
        local = torch.where(mine, input_ids - self.start, 0)
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, V]`` float32 logits on rank 0. The other ranks get zeros of that shape: what they sample
        from them is replaced by rank 0's tokens (``distributed/worker.py``)."""
        parts = self.tp.gather_to_driver(dense_matmul(hidden, self.weight).float())
        if parts is None:
            return hidden.new_zeros((hidden.shape[0], self.vocab), dtype=torch.float32)
        return torch.cat(parts, dim=-1)[:, : self.vocab]

    def shards(self, param: str) -> list[Shard]:
        return [Shard(None, (0, self.end - self.start), 0, (self.start, self.end))]
