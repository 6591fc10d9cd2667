"""Loading MoE checkpoints: routed experts from their checkpoint tensors into the stacked parameters.

In memory the experts of a layer are stacks ``[E, N, K]`` (``layers/moe.py::ExpertWeights``: ``gate_up_proj``
and ``down_proj``; ``models/expert_stacks.py::ExpertStacks`` for the blocks that are not a ``FusedMoE``). A
checkpoint holds either those stacks as they are (transformers 5's in-memory layout written as is) or, as
``save_pretrained`` writes them, one tensor per expert and projection, ``{block}.experts.{e}.{proj}.weight``,
whose rows are stacked (``gate_up_proj``: the gate's rows, then the up projection's).
:class:`ExpertCheckpointLayout` says how a family names them; :class:`MoECausalLMMixin` loads a ``CausalLM``
(``models/decoder.py``) with them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from forwardpass.errors import WeightShapeError
from forwardpass.layers.moe import ExpertWeights, FusedMoE, moe_layers, set_moe_impl
from forwardpass.loader.weights import WeightSource, checkpoint_names, load_into
from forwardpass.models.expert_stacks import ExpertStacks


@dataclass(frozen=True)
class ExpertCheckpointLayout:
    """How one architecture names its MoE tensors in ``save_pretrained`` checkpoints."""

    # module name of the MoE block in checkpoints: "mlp" (Qwen3-MoE) or "block_sparse_moe" (Mixtral)
    block: str
    gate: str = "gate_proj"  # per-expert gate projection name ("gate_proj" / "w1")
    up: str = "up_proj"  # ("up_proj" / "w3")
    down: str = "down_proj"  # ("down_proj" / "w2")
    #: stacked parameter → the per-expert projections whose rows it stacks, where the stacks are not
    #: ``gate_up_proj`` / ``down_proj`` (DeepSeek-V4's ``w13`` / ``w2``, Nemotron-H's
    #: ``up_proj`` / ``down_proj``)
    stacks: Mapping[str, tuple[str, ...]] = field(default_factory=dict, hash=False)

    def parts(self, which: str) -> tuple[str, ...]:
        """The per-expert projections stacked (row after row) in parameter ``which``."""
        if which in self.stacks:
            return self.stacks[which]
        return (self.gate, self.up) if which == "gate_up_proj" else (self.down,)


QWEN_EXPERT_LAYOUT = ExpertCheckpointLayout(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")
MIXTRAL_EXPERT_LAYOUT = ExpertCheckpointLayout(block="block_sparse_moe", gate="w1", up="w3", down="w2")


def load_expert_stack(param: torch.Tensor, source: WeightSource, block: str, which: str,
                      layout: ExpertCheckpointLayout = QWEN_EXPERT_LAYOUT) -> None:
    """Fill one stacked expert parameter (``gate_up_proj [E, 2I, H]`` or ``down_proj [E, H, I]``) from
    the per-expert tensors ``{block}.experts.{e}.{gate|up|down}.weight`` that ``save_pretrained`` writes."""
    parts = layout.parts(which)
    rows = param.shape[1] // len(parts)
    for e in range(param.shape[0]):
        for j, part in enumerate(parts):
            load_into(param[e, j * rows : (j + 1) * rows], source, f"{block}.experts.{e}.{part}.weight")


def _first_present(source: WeightSource, names: list[str]) -> str | None:
    return next((n for n in names if n in source), None)


def _blocks(block: str, layout: ExpertCheckpointLayout) -> list[str]:
    """Checkpoint names the MoE block ``block`` may be stored under: the layout's, then its own."""
    parent, _, own = block.rpartition(".")
    if not layout.block or layout.block == own:
        return [block]
    return [f"{parent}.{layout.block}" if parent else layout.block, block]


def load_experts(param: torch.Tensor, source: WeightSource, block: str, which: str,
                 layout: ExpertCheckpointLayout) -> None:
    """Stacked parameter ``{block}.experts.{which}`` (checkpoint names): the stack as stored, else its
    experts' tensors, refusing a checkpoint with more experts than the stack holds."""
    blocks = _blocks(block, layout)
    stacked = _first_present(source, [f"{b}.experts.{which}" for b in blocks])
    if stacked is not None:  # transformers-5 in-memory layout written as is
        load_into(param, source, stacked)
        return
    last = layout.parts(which)[-1]
    found = next((b for b in blocks if f"{b}.experts.0.{last}.weight" in source), blocks[0])
    load_expert_stack(param, source, found, which, layout)
    extra = f"{found}.experts.{param.shape[0]}.{last}.weight"
    if extra in source:
        raise WeightShapeError(
            f"the checkpoint in {source.model_dir} has more experts than config.json's {param.shape[0]} "
            f"(found {extra!r}); does config.json match the weights?"
        )


def load_moe_parameter(model: nn.Module, name: str, param: torch.Tensor, source: WeightSource,
                       layout: ExpertCheckpointLayout) -> bool:
    """Load ``name`` if it is a routed-expert stack or a ``FusedMoE`` router (whose block the layout may store
    under another name); False for every other parameter."""
    rename = getattr(model, "checkpoint_name", lambda n: n)
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    if isinstance(module, (ExpertWeights, ExpertStacks)):
        load_experts(param, source, rename(owner.removesuffix(".experts")), leaf, layout)
        return True
    block, _, router = owner.rpartition(".")
    if router == "gate" and leaf == "weight" and isinstance(model.get_submodule(block), FusedMoE):
        blocks = _blocks(rename(block), layout)
        load_into(param, source, _first_present(source, [f"{b}.gate.weight" for b in blocks])
                  or f"{blocks[0]}.gate.weight")
        return True
    return False


def load_moe_weights(model: nn.Module, source: WeightSource, layout: ExpertCheckpointLayout) -> None:
    """Load a model whose MoE blocks hold stacked experts: expert tensors from per-expert checkpoint names (or
    already-stacked ones) into the stacks, every other tensor by name."""
    for name, param in model.named_parameters():
        if not load_moe_parameter(model, name, param, source, layout):
            for ckpt, span in checkpoint_names(model, name):
                load_into(param if span is None else param[span[0] : span[1]], source, ckpt)


class MoECausalLMMixin:
    """Shared by the MoE architectures (before ``CausalLM`` in the bases): stacked experts loaded from their
    checkpoint tensors (``expert_layout``), routing counts, implementation switch."""

    expert_layout: ExpertCheckpointLayout = QWEN_EXPERT_LAYOUT

    def load_parameter(self, name: str, param: torch.Tensor, source: WeightSource) -> None:
        if not load_moe_parameter(self, name, param, source, self.expert_layout):  # type: ignore[arg-type]
            super().load_parameter(name, param, source)  # type: ignore[misc]

    def moe_layers(self) -> list[tuple[int, FusedMoE]]:
        return moe_layers(self)  # type: ignore[arg-type]

    def routing_counts(self) -> list[list[int]]:
        """Tokens each expert received in the last forward, one list per MoE layer."""
        return [moe.tokens_per_expert.tolist() if moe.tokens_per_expert is not None else [0] * moe.num_experts
                for _, moe in self.moe_layers()]

    def set_moe_impl(self, impl: str) -> None:
        set_moe_impl(self, impl)  # type: ignore[arg-type]

