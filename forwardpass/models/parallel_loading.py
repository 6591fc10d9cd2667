"""Load one rank's shard of a checkpoint: only its rows or columns of every split tensor are read.

``safe_open(...).get_slice(name)[a:b]`` reads just that part of the memory-mapped file, so a rank
never materialises a whole split tensor (embedding, q/k/v, MLP, experts), let alone the whole model.
Each sharded parameter's module says where its rows come from (``Shard``, ``layers/parallel_linear``);
replicated parameters (norms, the MoE router, row-parallel biases) are read whole — they are small.
"""

from __future__ import annotations

import re

import torch
from safetensors import safe_open
from torch import nn

from forwardpass.errors import MissingTensorError, WeightShapeError
from forwardpass.layers.moe import ExpertWeights
from forwardpass.layers.parallel_linear import Shard
from forwardpass.layers.parallel_moe import ParallelFusedMoE
from forwardpass.loader.weights import WeightSource, load_into
from forwardpass.models.moe_loading import QWEN_EXPERT_LAYOUT, ExpertCheckpointLayout


class SliceReader:
    """Slices of checkpoint tensors by name (``get_slice``: only the requested part is read)."""

    def __init__(self, source: WeightSource):
        self.source = source
        self._handle_of = {}
        for file in source.files:
            handle = safe_open(str(file), framework="pt")
            for name in handle.keys():  # noqa: SIM118 - a safe_open handle, not a dict
                self._handle_of[name] = handle

    def __contains__(self, name: str) -> bool:
        return name in self._handle_of

    def read(self, name: str, dim: int, span: tuple[int, int], index: int | None = None) -> torch.Tensor:
        """``tensor[index]`` (if given) sliced to ``span`` along ``dim`` (of the indexed tensor)."""
        shape = self.source.shape(name)  # a missing tensor raises the loader's error with close names
        if index is not None:
            shape = shape[1:]
        if dim >= len(shape) or span[1] > shape[dim]:
            raise WeightShapeError(
                f"tensor {name!r} in {self.source.model_dir} has shape {shape}; this rank needs "
                f"[{span[0]}:{span[1]}] of dim {dim}: does config.json match the weights?"
            )
        sl = self._handle_of[name].get_slice(name)
        lead = () if index is None else (index,)
        return sl[(*lead, *([slice(None)] * dim), slice(*span))]


def _copy(target: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(tensor.shape) != tuple(target.shape):
        raise WeightShapeError(
            f"tensor {name!r}: this rank's slice has shape {tuple(tensor.shape)}, expected "
            f"{tuple(target.shape)}; does config.json match the weights?"
        )
    target.copy_(tensor)


def _load_shards(
    param: torch.Tensor, shards: list[Shard], module_name: str, attr: str, reader: SliceReader
) -> None:
    parent = module_name.rpartition(".")[0]
    for shard in shards:
        ckpt_module = module_name if shard.checkpoint is None else f"{parent}.{shard.checkpoint}".lstrip(".")
        name = f"{ckpt_module}.{attr}"
        _copy(param[shard.rows[0] : shard.rows[1]], reader.read(name, shard.dim, shard.span), name)


def _load_experts(
    param: torch.Tensor,
    moe: ParallelFusedMoE,
    blocks: list[str],
    which: str,
    layout: ExpertCheckpointLayout,
    reader: SliceReader,
) -> None:
    experts, shards = moe.expert_shards(which)
    stacked = next((f"{b}.experts.{which}" for b in blocks if f"{b}.experts.{which}" in reader), None)
    block = next((b for b in blocks if f"{b}.experts.0.{layout.down}.weight" in reader), blocks[0])
    inter = moe.intermediate_size
    for local, e in enumerate(experts):
        for shard in shards:
            target = param[local, shard.rows[0] : shard.rows[1]]
            if stacked is not None:  # [E, 2I, H] (gate rows, then up rows) / [E, H, I]: index the expert
                offset = inter if shard.checkpoint == "up" else 0
                span = (shard.span[0] + offset, shard.span[1] + offset)
                _copy(target, reader.read(stacked, shard.dim, span, index=e), stacked)
            else:
                name = f"{block}.experts.{e}.{getattr(layout, shard.checkpoint or '')}.weight"
                _copy(target, reader.read(name, shard.dim, shard.span), name)


def load_sharded(model: nn.Module, source: WeightSource) -> None:
    """Fill a model built under a tensor-parallel plan (``plan.tensor_parallel``) with this rank's part of
    every weight."""
    from forwardpass.loader.weights import checkpoint_names

    reader = SliceReader(source)
    layout = getattr(model, "expert_layout", QWEN_EXPERT_LAYOUT)
    modules = dict(model.named_modules())
    moe_prefix = re.compile(r"^(model\.layers\.\d+)\.mlp\.")
    for name, param in model.named_parameters():
        module_name, _, attr = name.rpartition(".")
        module = modules[module_name]
        m = moe_prefix.match(name)
        moe = modules.get(f"{m.group(1)}.mlp") if m else None
        if isinstance(moe, ParallelFusedMoE) and m is not None:
            blocks = [f"{m.group(1)}.{layout.block}", f"{m.group(1)}.mlp"]
            if isinstance(module, ExpertWeights):
                _load_experts(param, moe, blocks, attr, layout, reader)
            else:  # the router, replicated
                rest = name[m.end() :]
                ckpt = next((f"{b}.{rest}" for b in blocks if f"{b}.{rest}" in reader), None)
                if ckpt is None:
                    raise MissingTensorError(
                        f"tensor {blocks[0]}.{rest!r} is not in the checkpoint in {source.model_dir}"
                    )
                load_into(param, source, ckpt)
        elif hasattr(module, "shards"):
            _load_shards(param, module.shards(attr), module_name, attr, reader)
        else:  # replicated (norms): read whole, as without parallelism
            for ckpt_name, span in checkpoint_names(model, name):
                load_into(param if span is None else param[span[0] : span[1]], source, ckpt_name)
