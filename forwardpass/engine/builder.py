"""``build_engine_core(model_dir, EngineConfig)``: resolve the execution plan, prepare the model with it, and
wire the engine core together.

Every plug-in is decided here and handed to a constructor: the execution plan (weight methods, compiled
kernels, decode stack, huge pages: ``models/prepare.py``, resolved before the model is built and fixed for the
engine's lifetime), the KV cache layout (from the model spec and the memory budget), LoRA (the plan gives the
model's linear layers an adapter slot as they are built; the manager is the scheduler's admission policy and
the runner's per-step adapter mapping), MoE routing counts, and the per-step cost model.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch

from forwardpass.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig, SpeculativeConfig
from forwardpass.engine.core import EngineCore
from forwardpass.engine.executor import Executor, LocalExecutor
from forwardpass.engine.scheduling.checkpoint_defaults import with_checkpoint_defaults
from forwardpass.engine.scheduling.cost import StepCostModel
from forwardpass.engine.scheduling.kv_cache import KVCacheManager
from forwardpass.engine.scheduling.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    StateSpec,
    groups_too_short,
    layer_specs,
    plan_groups,
    sequence_capacity,
    slots_that_fit,
)
from forwardpass.engine.scheduling.scheduler import Scheduler
from forwardpass.engine.speculative.mtp_stash import hidden_sink
from forwardpass.engine.speculative.policy import build_speculator
from forwardpass.engine.speculative.rows import decode_row_limit
from forwardpass.engine.speculative.verify import SpeculativeVerifier
from forwardpass.engine.worker.plugins import CausalLM
from forwardpass.engine.worker.routing_stats import ModelRoutingCounter, RoutingStats
from forwardpass.errors import ConfigError
from forwardpass.layers.moe import moe_layers
from forwardpass.layers.weight_report import described_plan
from forwardpass.loader.generation_config import GenerationDefaults, load_generation_config
from forwardpass.loader.gguf import check_gguf_dir
from forwardpass.loader.tokenizer import Tokenizer
from forwardpass.lora.manager import LoRABatch, LoRAManager
from forwardpass.models.model_spec import ModelSpec
from forwardpass.models.prepare import prepare_model, resolve_plan
from forwardpass.plan import ExecutionPlan
from forwardpass.structured.backend import GrammarBackend

logger = logging.getLogger(__name__)
_NO_POSITION_LIMIT = 1 << 20


def resolve_eos_token_ids(model_dir: Path, spec: ModelSpec) -> tuple[list[int], GenerationDefaults]:
    """Stop tokens: generation_config.json's and config.json's, plus the tokenizer's EOS token."""
    defaults = load_generation_config(model_dir, spec)
    eos = list(defaults.eos_token_ids)
    if (model_dir / "tokenizer.json").exists():
        tok_eos = Tokenizer.from_dir(model_dir).eos_token_id
        if tok_eos is not None and tok_eos not in eos:
            eos.append(tok_eos)
    return eos, defaults


def build_engine_core(
    model: str | Path,
    config: EngineConfig | None = None,
    *,
    core_cls: type[EngineCore] = EngineCore,
    executor: Executor | None = None,
    model_builder: Callable[[ExecutionPlan], tuple[torch.nn.Module, ModelSpec]] | None = None,
) -> EngineCore:
    """The engine core for ``model`` (a model directory), its steps run by ``executor`` (default: this
    process; ``engine/frontend/launch.py`` starts tensor-parallel ranks and passes their executor).
    ``model_builder`` builds and prepares the model with the resolved plan instead of loading it from the
    directory (a probe model of a made-up shape)."""
    model_dir = Path(model)
    config = config or EngineConfig()
    executor = executor or LocalExecutor()
    if config.tensor_parallel_size != executor.size:
        raise ConfigError(f"tensor_parallel_size={config.tensor_parallel_size} but the executor has "
                          f"{executor.size} rank(s): build tensor-parallel engines with "
                          "forwardpass.engine.frontend.launch.build_engine_core",
                          param="tensor_parallel_size")
    check_gguf_dir(model_dir)  # a GGUF file we cannot load: refused from its header, before compiling kernels
    config = with_checkpoint_defaults(config, model_dir)  # what `auto` means for this checkpoint
    dtype = config.torch_dtype
    # ----- the plan, then the model built with it ----------------------------------------------------------
    lora_batch = LoRABatch() if config.enable_lora else None
    plan = resolve_plan(config, model_dir,
                        lora_slot=LoRAManager.slot_factory(lora_batch) if lora_batch else None)
    if model_builder is not None:
        net, spec = model_builder(plan)
    else:
        net, spec = prepare_model(model_dir, executor.rank_plan(plan))  # tensor parallel: this rank's shard
    # with the weights as loaded (their formats and kernels): what /v1/models and explain show too
    logger.info("execution plan: %s", described_plan(plan, net))
    eos, defaults = resolve_eos_token_ids(model_dir, spec)

    # ----- KV budget -------------------------------------------------------------------------------
    kv_spec = executor.local_spec(spec)  # this rank's KV heads
    # the loaded model asked when this rank holds all of it: a meta-device build imports torch._dynamo
    specs = _layer_specs(kv_spec, config, net if kv_spec is spec else None)
    budget, chunk = config.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY, config.max_num_batched_tokens
    if config.num_kv_blocks is None:  # per-request state slots are paid first: as many requests as leave room
        longest = config.max_model_len or spec.max_position_embeddings or chunk
        fit = slots_that_fit(specs, budget, config.max_num_seqs, longest, chunk)
        config = dataclasses.replace(config, max_num_seqs=fit or config.max_num_seqs)  # 0: refused below
    groups = plan_groups(specs, budget, config.num_kv_blocks, config.max_num_seqs)
    paged = [g for g in groups if not isinstance(g.spec, StateSpec)]
    num_blocks = paged[0].num_blocks if paged else groups[0].num_blocks
    for g in groups:
        if isinstance(g.spec, StateSpec):
            logger.info("state slots: %d layers x %d bytes per request (constant in its length), %d slots = "
                        "%d bytes; prefix caching is off for them", len(g.layer_ids),
                        g.spec.page_bytes_per_layer, g.num_blocks, g.page_bytes * g.num_blocks)
    # what one sequence can hold: windowed groups free blocks behind the window as it grows
    capacity = sequence_capacity(groups, chunk)
    # a model without positions (Mamba2) whose cache does not grow has no length limit of its own
    max_pos = spec.max_position_embeddings or capacity or _NO_POSITION_LIMIT
    max_model_len = (config.max_model_len if config.max_model_len is not None
                     else min(max_pos, capacity or max_pos))
    short = groups_too_short(groups, max_model_len, chunk)
    if short or num_blocks < 1 or max_model_len < 2:
        per_block = sum(g.page_bytes for g in groups)
        held = max(g.spec.max_blocks_per_sequence(max_model_len, chunk) for g in groups)
        raise ConfigError(
            f"the KV cache has {num_blocks} blocks of {config.block_size} tokens ({per_block} bytes each) "
            f"but one sequence of max_model_len={max_model_len} tokens (computed {chunk} at a time) holds up "
            f"to {held}: raise kv_cache_memory / num_kv_blocks or lower max_model_len (or "
            "max_num_batched_tokens for a sliding-window model)",
            param="max_model_len",
        )
    if max_model_len > max_pos:
        logger.warning(
            "max_model_len %d exceeds the model's max_position_embeddings %d", max_model_len, max_pos
        )

    # ----- plug-ins --------------------------------------------------------------------------------
    lora = None
    if lora_batch is not None:
        lora = LoRAManager(net, spec, lora_batch, max_loras=config.max_loras,
                           max_lora_rank=config.max_lora_rank, max_cpu_loras=config.max_cpu_loras,
                           dtype=dtype, device=config.device)
    has_moe = bool(moe_layers(net))
    routing_stats = RoutingStats(maxlen=config.max_stats_records) if has_moe else None
    try:  # FLOPs / bytes per step for achieved FLOP/s and GB/s; optional, never fatal
        cost = StepCostModel(spec, torch.empty((), dtype=dtype).element_size(), *_weight_bytes(config),
                             kv_dtype_bytes=torch.empty((), dtype=config.torch_kv_dtype).element_size())
    except Exception as exc:  # noqa: BLE001 - an exotic config the accounting can't read
        logger.warning("no FLOP/byte accounting for this model: %s", exc)
        cost = None

    # refuses caches that can't roll back
    speculator = build_speculator(SpeculativeConfig.from_value(config.speculative_config), groups,
                                  {"target_dir": model_dir, "engine": config, "target_vocab": spec.vocab,
                                   "target": net, "plan": plan})
    if speculator is not None:  # verify rows stay within the rows the decode kernels take
        speculator.limit_step_rows(decode_row_limit(net), config.max_num_batched_tokens)
    kv = KVCacheManager(groups, config.enable_prefix_caching)
    scheduler = Scheduler(
        kv,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len,
        eos_token_ids=eos,
        admission=lora,
        fair_share_tokens=config.fair_share_tokens,
        speculator=speculator,
    )
    kernel = plan.kernels.decode
    runner = executor.make_runner(
        cast(CausalLM, net),  # every registered model class has forward + compute_logits
        groups,
        dtype=dtype,
        device=config.device,
        attention_backend=config.attention_backend,
        eos_token_ids=eos,
        decode_kernel=kernel,
        adapters=lora,
        routing=ModelRoutingCounter(net) if has_moe else None,
        hidden_sink=hidden_sink(speculator.proposer) if speculator else None,  # mtp
        verifier=SpeculativeVerifier() if speculator else None,  # checks the drafts the scheduler adds
        # structured output needs the vocabulary; the tokenizer is read on the first such request
        grammars=(GrammarBackend(model_dir, spec.vocab, eos) if (model_dir / "tokenizer.json").exists()
                  else None),
    )
    # the other ranks build the same KV cache, the same kernel
    executor.share_setup(groups, kernel is not None)
    torch.manual_seed(config.seed)  # unseeded requests draw from the global generator
    return core_cls(
        model_dir=model_dir,
        config=config,
        model=net,
        spec=spec,
        kv=kv,
        scheduler=scheduler,
        runner=runner,
        max_model_len=max_model_len,
        generation_defaults=defaults,
        eos_token_ids=eos,
        lora=lora,
        routing_stats=routing_stats,
        cost=cost,
        plan=plan,
    )


def _layer_specs(spec: ModelSpec, config: EngineConfig, net: torch.nn.Module | None
                 ) -> list[KVCacheSpec | None]:
    """What each layer caches, in ``config.kv_cache_dtype``: that applies to plain K/V pages only (the other
    caches are read by code that computes in the model's dtype), so a model with any
    other cache refuses it."""
    specs = layer_specs(spec, config.block_size, config.torch_dtype, net)
    if config.torch_kv_dtype == config.torch_dtype:
        return specs
    other = {type(s).__name__ for s in specs
             if s is not None and type(s) not in (FullAttentionSpec, SlidingWindowSpec)}
    if other:
        raise ConfigError(
            f"kv_cache_dtype={config.kv_cache_dtype} applies to models whose layers cache plain keys and "
            f"values; this one also keeps {', '.join(sorted(other))}: leave it at auto",
            param="kv_cache_dtype",
        )
    return [None if s is None else dataclasses.replace(cast(FullAttentionSpec, s),
                                                       dtype=config.torch_kv_dtype)
            for s in specs]


def _weight_bytes(config: EngineConfig) -> tuple[float | None, float | None]:
    """Bytes per weight of the layers and of the LM head when quantized (None: the dtype's)."""
    if config.quantization is None:
        return None, None
    from forwardpass.quant.apply import HEAD_FORMAT, QUANTIZATIONS
    from forwardpass.quant.formats import BYTES_PER_WEIGHT

    return BYTES_PER_WEIGHT[QUANTIZATIONS[config.quantization]], BYTES_PER_WEIGHT[HEAD_FORMAT]
