"""Read a PEFT LoRA adapter directory and check it against the model it is meant for.

A PEFT directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
``use_rslora``, ...) and ``adapter_model.safetensors`` with, for each targeted projection ``P``,
``base_model.model.<P>.lora_A.weight [r, in]`` and ``...lora_B.weight [out, r]``. Our models merge
q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` (``packed_modules``), so an adapter on
``q_proj`` becomes a delta on the q slice of ``qkv_proj``'s output. Per merged module the adapter is
stored ready to run: ``A`` stacks the sub-projections' ``lora_A`` (``[Σr, in]``) and ``B`` is block
structured (``[out_total, Σr]``, each sub-projection's ``lora_B`` in its own rows and columns, zero
elsewhere) with the scaling folded in, so one adapter costs two matmuls per module.

Everything that would silently compute something else is refused with the reason: DoRA,
``modules_to_save``, LoRA biases, ``fan_in_fan_out``, embedding / lm_head adapters, a rank over
``max_lora_rank``, a target module the model lacks, tensors of the wrong shape, an adapter made for
another architecture.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from forwardpass.layers.linear import Linear, MergedLinear
from forwardpass.loader.jsonfile import read_json_object
from forwardpass.loader.paths import model_file
from forwardpass.lora.errors import LoRAAdapterError
from forwardpass.models.model_spec import ModelSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>A|B)(?:\.(?P<adapter>[^.]+))?\.weight$")


@dataclass
class ModuleLoRA:
    """One adapter's weights for one of our (possibly merged) linear modules."""

    A: torch.Tensor  # [Σr, in]: lora_A of each targeted sub-projection, stacked
    B: torch.Tensor  # [out_total, Σr]: scaling · lora_B of each, block structured
    rank: int  # Σr


@dataclass
class LoRAAdapter:
    name: str
    lora_int_id: int
    path: Path
    rank: int  # largest rank of any module
    scaling: float  # of the default rank / alpha (rank_pattern / alpha_pattern may differ per module)
    modules: dict[str, ModuleLoRA] = field(default_factory=dict)  # our module name -> weights
    config: dict = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return sum(m.A.numel() * m.A.element_size() + m.B.numel() * m.B.element_size()
                   for m in self.modules.values())


def _err(adapter: str, msg: str) -> LoRAAdapterError:
    return LoRAAdapterError(f"LoRA adapter {adapter}: {msg}", param="lora_request")


def read_adapter_config(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise LoRAAdapterError(f"LoRA adapter path {str(path)!r} is not a directory; pass a directory "
                               "written by PeftModel.save_pretrained", param="lora_request")
    cfg_path = model_file(path, CONFIG_FILE)
    if not cfg_path.is_file():
        raise LoRAAdapterError(f"{cfg_path} is missing: a PEFT adapter directory needs {CONFIG_FILE}",
                               param="lora_request")
    return read_json_object(cfg_path, error=LoRAAdapterError, param="lora_request")


def check_adapter_config(cfg: dict, where: str) -> None:
    """Refuse PEFT features we do not implement (instead of computing something else)."""
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise _err(where, f"peft_type is {peft_type!r}; only LORA adapters are supported")
    if cfg.get("use_dora"):
        raise _err(where, "DoRA (use_dora=true) is not supported; only plain LoRA adapters are")
    if cfg.get("modules_to_save"):
        raise _err(where, f"modules_to_save={cfg['modules_to_save']!r} is not supported: the adapter "
                          "replaces whole modules (e.g. a fine-tuned lm_head), which cannot be shared across "
                          "a batch; train without it")
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
        raise _err(where, "LoRA bias terms (bias != 'none' or lora_bias=true) are not supported")
    if cfg.get("fan_in_fan_out"):
        raise _err(where, "fan_in_fan_out=true (Conv1D base layers) is not supported")
    if cfg.get("target_parameters"):
        raise _err(where, f"target_parameters={cfg['target_parameters']!r} (LoRA on raw parameters, which is "
                          "how PEFT adapts fused MoE experts) is not supported; target the linear layers "
                          "(q/k/v/o_proj, dense MLPs) only")
    if cfg.get("layer_replication"):
        raise _err(where, "layer_replication is not supported")
    for key in ("r", "lora_alpha"):
        if not isinstance(cfg.get(key), (int, float)) or cfg[key] <= 0:
            raise _err(where, f"adapter_config.json needs a positive {key!r}, got {cfg.get(key)!r}")


def adapter_rank(path: str | Path) -> int:
    """The largest rank in an adapter's config (``r`` and any ``rank_pattern`` entry)."""
    cfg = read_adapter_config(path)
    return int(max([cfg.get("r") or 0, *(cfg.get("rank_pattern") or {}).values()]))


#: A quantifier right after a group, ``(a+)+``: the shape of patterns that backtrack exponentially.
_NESTED_QUANTIFIER = re.compile(r"\)[*+?{]")


@lru_cache(maxsize=256)
def _safe_pattern(key: str) -> re.Pattern[str]:
    """``rank_pattern`` keys come with downloaded adapters: plain module names, or regexes without
    quantified groups (which can backtrack for ever) and at most 256 characters."""
    if len(key) > 256 or _NESTED_QUANTIFIER.search(key):
        raise LoRAAdapterError(
            f"rank_pattern / alpha_pattern key {key[:80]!r} is refused: use module names or simple regexes "
            "(at most 256 characters, no quantified groups such as '(a+)+')", param="lora_request")
    try:
        return re.compile(rf"(?:.*\.)?(?:{key})$")
    except re.error as exc:
        raise LoRAAdapterError(f"rank_pattern / alpha_pattern key {key[:80]!r} is not a valid regex: {exc}",
                               param="lora_request") from exc


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rule for ``rank_pattern`` / ``alpha_pattern``: a key matches a module name suffix (regex)."""
    for key, value in (patterns or {}).items():
        if _safe_pattern(str(key)).match(module):
            return value
    return default


def adapter_targets(model: nn.Module) -> dict[str, tuple[str, str | None]]:
    """Checkpoint (HF) module name → (our module name, slice name in a merged module or None).

    The LM head is not a target: logits are computed from its weight directly (``compute_logits``),
    so an adapter on it would be silently ignored; it is refused like embedding adapters instead."""
    packed = getattr(model, "packed_modules", {})
    out: dict[str, tuple[str, str | None]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or module.role == "lm_head":
            continue
        parent, _, leaf = name.rpartition(".")
        if isinstance(module, MergedLinear) and leaf in packed:
            for sub in packed[leaf]:
                out[f"{parent}.{sub}" if parent else sub] = (name, sub)
        else:
            out[name] = (name, None)
    return out


def load_adapter(request, model: nn.Module, spec: ModelSpec, max_lora_rank: int,
                 dtype: torch.dtype = torch.float32, device: str = "cpu") -> LoRAAdapter:
    """Load ``request`` (a :class:`LoRARequest`) for ``model`` (described by ``spec``), validating
    everything up front."""
    from safetensors import safe_open

    path = Path(request.lora_path)
    where = f"{request.lora_name!r} ({path})"
    cfg = read_adapter_config(path)
    check_adapter_config(cfg, where)

    base_cls = (cfg.get("auto_mapping") or {}).get("base_model_class")
    arch = spec.architecture
    if base_cls and arch and base_cls != arch:
        raise _err(where, f"it was trained on a {base_cls} but this model is a {arch}")

    weights = model_file(path, WEIGHTS_FILE)
    if not weights.is_file():
        if (path / "adapter_model.bin").is_file():
            raise _err(where, "only adapter_model.bin (pickle) is present; pickle files are never loaded. "
                              "Convert: PeftModel.from_pretrained(base, dir).save_pretrained(dir, "
                              "safe_serialization=True)")
        raise _err(where, f"{WEIGHTS_FILE} is missing")

    targets = adapter_targets(model)
    target_modules = cfg.get("target_modules")
    if isinstance(target_modules, list):  # a regex string or "all-linear" is checked through the tensors
        leaves = {name.rpartition(".")[2] for name in targets}
        missing = sorted(t for t in target_modules if t not in leaves and t not in targets)
        if missing:
            raise _err(where, f"target module(s) {missing} do not exist as linear layers in this "
                              f"{arch or 'model'} (it has {sorted(leaves)}); LoRA on embeddings, lm_head or "
                              "MoE experts is not supported")

    # Collect A and B per checkpoint module.
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    try:
        handle = safe_open(str(weights), framework="pt")
    except Exception as exc:
        raise _err(where, f"{weights} could not be read ({exc})") from exc
    for key in handle.keys():  # noqa: SIM118 - a safe_open handle is not iterable
        m = _KEY.match(key)
        if m is None or "lora_embedding" in key or "lora_magnitude" in key:
            raise _err(where, f"tensor {key!r} is not a LoRA A/B weight of a linear layer (embedding "
                              "adapters, DoRA magnitudes and other extras are not supported)")
        module = m.group("module")
        module = module.removeprefix(_PREFIX)
        pairs.setdefault(module, {})[m.group("ab")] = handle.get_tensor(key)

    default_r, default_alpha = cfg["r"], cfg["lora_alpha"]
    use_rslora = bool(cfg.get("use_rslora"))

    def scaling_of(r, alpha):
        return alpha / math.sqrt(r) if use_rslora else alpha / r

    # Group sub-projections per our module.
    per_module: dict[str, list[tuple[str | None, torch.Tensor, torch.Tensor, float]]] = {}
    max_rank = 0
    for ckpt_module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise _err(where, f"module {ckpt_module!r} has lora_{'A' if 'A' in ab else 'B'} but not its "
                              "partner")
        if ckpt_module not in targets:
            leaf = ckpt_module.rpartition(".")[2]
            hint = ("LoRA on embeddings / lm_head is not supported" if leaf in ("embed_tokens", "lm_head")
                    else "the module does not exist or is not a linear layer here (MoE experts are not "
                         "supported), or the adapter was made for another architecture")
            raise _err(where, f"target module {ckpt_module!r}: {hint}")
        A, B = ab["A"], ab["B"]
        r = A.shape[0]
        if A.dim() != 2 or B.dim() != 2 or B.shape[1] != r:
            raise _err(where, f"module {ckpt_module!r}: lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)} "
                              "do not form a rank-r pair")
        if r > max_lora_rank:
            raise _err(where, f"rank {r} (module {ckpt_module!r}) exceeds max_lora_rank={max_lora_rank}; "
                              f"start the engine with max_lora_rank>={r}")
        max_rank = max(max_rank, r)
        ours, sub = targets[ckpt_module]
        base = model.get_submodule(ours)
        out_size = base.output_sizes[sub] if sub is not None else base.out_features
        if A.shape[1] != base.in_features or B.shape[0] != out_size:
            raise _err(where, f"module {ckpt_module!r} expects lora_A [r, {base.in_features}] and lora_B "
                              f"[{out_size}, r], the adapter has {tuple(A.shape)} and {tuple(B.shape)}: it "
                              "was made for a model of another shape")
        r_cfg = _pattern_value(cfg.get("rank_pattern"), ckpt_module, default_r)
        alpha = _pattern_value(cfg.get("alpha_pattern"), ckpt_module, default_alpha)
        if r_cfg != r:
            raise _err(where, f"module {ckpt_module!r} has rank {r} but adapter_config.json says r={r_cfg}")
        per_module.setdefault(ours, []).append((sub, A, B, scaling_of(r, alpha)))
    if not per_module:
        raise _err(where, f"{WEIGHTS_FILE} holds no LoRA weights")

    adapter = LoRAAdapter(request.lora_name, request.lora_int_id, path, max_rank,
                          scaling_of(default_r, default_alpha), config=cfg)
    for ours, parts in per_module.items():
        base = model.get_submodule(ours)
        total_r = sum(p[1].shape[0] for p in parts)
        A_all = torch.empty(total_r, base.in_features, dtype=dtype, device=device)
        B_all = torch.zeros(base.out_features, total_r, dtype=dtype, device=device)
        col = 0
        for sub, A, B, scaling in parts:
            r = A.shape[0]
            lo, hi = base.offsets[sub] if sub is not None else (0, base.out_features)
            A_all[col : col + r] = A.to(dtype)
            B_all[lo:hi, col : col + r] = (B.to(torch.float64) * scaling).to(dtype)
            col += r
        adapter.modules[ours] = ModuleLoRA(A_all, B_all, total_r)
    return adapter
