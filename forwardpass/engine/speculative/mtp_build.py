"""Building the MTP proposer (``mtp.py``) at start-up: the checks, the layer's weights, its KV pool.

The MTP layer's tensors sit in the target's own checkpoint (``model.layers.{num_hidden_layers}.*``); the main
model never reads them, so they are loaded here, only when ``method: mtp`` asks for them. A checkpoint
without them is refused with a ``ConfigError`` naming ``speculative_config.method``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from forwardpass.config import EngineConfig, SpeculativeConfig
from forwardpass.engine.scheduling.kv_cache_spec import KVCacheGroup
from forwardpass.engine.speculative.draft_cache import build_draft_cache
from forwardpass.engine.speculative.mtp import MTPProposer
from forwardpass.errors import ConfigError

logger = logging.getLogger(__name__)

#: architectures whose checkpoints store DeepSeek-V3's MTP layer layout (models/deepseek_mtp.py)
MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM",)


def _refuse(why: str) -> ConfigError:
    return ConfigError(f"speculative_config.method mtp: {why}; use method ngram or draft_model",
                       param="speculative_config.method")


def check_mtp_checkpoint(target_dir: Path) -> int:
    """``num_nextn_predict_layers`` of a checkpoint ``mtp`` can read; a ``ConfigError`` otherwise."""
    from forwardpass.loader.config import load_model_config
    from forwardpass.loader.gguf import is_gguf_dir

    if is_gguf_dir(target_dir):
        raise _refuse("the MTP layers are read from safetensors checkpoints, not GGUF files")
    cfg = load_model_config(target_dir)
    n = cfg.get("num_nextn_predict_layers") or 0
    if not isinstance(n, int) or n < 1:
        raise _refuse(f"this checkpoint has no next-token-prediction layers (num_nextn_predict_layers = {n})")
    if cfg.architecture not in MTP_ARCHITECTURES:
        raise _refuse(f"the next-token-prediction layers of {cfg.architecture} are not supported (only "
                      f"{', '.join(MTP_ARCHITECTURES)}'s)")
    return n


def build_mtp_proposer(config: SpeculativeConfig, target_dir: Path, engine: EngineConfig, target: Any,
                       plan: Any, target_groups: Sequence[KVCacheGroup]) -> MTPProposer:
    """The MTP layer of ``target``'s checkpoint built with the target's plan (no LoRA slots), loaded, its
    KV pool sized as the draft model's: the target pool's tokens plus ``k`` for every sequence."""
    from forwardpass.loader.weights import WeightSource
    from forwardpass.models.deepseek_mtp import DeepseekMTP, copy_of, mtp_prefix
    from forwardpass.models.prepare import process_weights_after_loading
    from forwardpass.plan import building_with_plan

    layers = check_mtp_checkpoint(Path(target_dir))
    spec = target.spec
    source = WeightSource.from_dir(target_dir)
    prefix = mtp_prefix(spec)
    if f"{prefix}.eh_proj.weight" not in source:
        raise _refuse(f"config.json says num_nextn_predict_layers = {layers}, but the checkpoint has no "
                      f"{prefix}.* tensors (some conversions drop them)")
    head = "model.embed_tokens.weight" if spec.tied else "lm_head.weight"
    own_head = not copy_of(source, f"{prefix}.shared_head.head.weight", head)
    own_embed = not copy_of(source, f"{prefix}.embed_tokens.weight", "model.embed_tokens.weight")
    prev = torch.get_default_dtype()
    with building_with_plan(dataclasses.replace(plan, lora_slot=None)), torch.device(engine.device):
        torch.set_default_dtype(plan.dtype)
        try:
            mtp = DeepseekMTP(spec, own_head=own_head, own_embed=own_embed)
        finally:
            torch.set_default_dtype(prev)
    mtp.eval().requires_grad_(False)
    with torch.no_grad():
        mtp.load_weights(source)
    process_weights_after_loading(mtp)
    cache, groups, size = build_draft_cache(spec, mtp, engine, target_groups, config.num_speculative_tokens)
    logger.info("mtp: layer %s of %s (%d in the checkpoint, the first reused for every draft)%s%s, KV pool "
                "of %d blocks (%.1f MB)", spec.layers, target_dir, layers, ", own head" if own_head else "",
                ", own embedding" if own_embed else "", groups[0].num_blocks, size / 1e6)
    return MTPProposer(mtp, target, cache, device=engine.device, attention_backend=engine.attention_backend,
                       decode_kernel=plan.kernels.decode, max_len=spec.max_position_embeddings or None)
