"""``ModelSpec``: config.json read once into a typed, frozen description of the model.

Hugging Face configs leave much implicit (``head_dim``, ``num_key_value_heads``, which layers use a
sliding window, which layers are sparse MoE, where rope settings live) and spell the same thing
differently across families. All of that is resolved once, into a ``ModelSpec``: models, the model runner,
the KV cache manager, the per-step cost model and the roofline analyzer read it; nothing else reads raw
config keys.

This module is the common core: the fields, the keys most decoders share (Llama's names: ``decoder_spec``,
with the generic MoE keys, ``rope_parameters`` and the ``layer_types`` / ``use_sliding_window`` windows),
and the checks every spec passes (``__post_init__``). Each family that reads keys of its own derives its
spec in a module next to its model (``models/*_spec.py``), registered by architecture and model_type in
``models/registry.py``; ``ModelSpec.from_config`` asks that registry first. Its own sizes go into one
sub-spec, ``ModelSpec.family`` (Gemma's ``GemmaSpec``, DeepSeek's ``MLAFamily``, Mamba2 / Nemotron-H's
``SSMSpec``, Qwen3-Next's ``GDNSpec``, DeepSeek-V4's ``DeepseekV4Spec``, Whisper's ``WhisperSpec``, ...),
which is also the family's one interface to the rest of the code (``models/family.py``).

Parameter and byte counts (``spec.params``, ``spec.kv_bytes_per_token(b)``, ...) are
``models/accounting.py``'s, shared by the cost model and the analyzer. Field names are short (``hidden``,
``layers``, ``heads``) because those formulas read like the equations they implement.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forwardpass.errors import ConfigError
from forwardpass.loader.config import eos_token_ids, load_model_config
from forwardpass.loader.validate import validate_config
from forwardpass.models import accounting
from forwardpass.models.moe_spec import MoESpec, moe_spec

if TYPE_CHECKING:
    from forwardpass.models.deepseek_spec import MLAFamily
    from forwardpass.models.deepseek_v4_spec import DeepseekV4Spec
    from forwardpass.models.mamba_spec import SSMSpec
    from forwardpass.models.qwen3_next_spec import GDNSpec
    from forwardpass.models.whisper_spec import WhisperSpec

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

# what a decoder layer mixes with (``ModelSpec.layer_mixers``); () means attention + MLP in every layer
MIXER_ATTENTION = "attention"  # attention (paged KV) and, unless the model says otherwise, an MLP
MIXER_MAMBA = "mamba"  # a Mamba2 mixer: a fixed-size state per request (conv window + SSM state)
MIXER_MLP = "mlp"  # an MLP alone (Nemotron-H "-" layers): nothing cached
MIXER_MOE = "moe"  # a MoE alone (Nemotron-H "E" layers): nothing cached
MIXER_GDN = "gated_deltanet"  # Gated DeltaNet linear attention (Qwen3-Next): a fixed-size state per request

LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)

#: a family's derivation: (config.json mapping, display name) -> its ModelSpec
#: (registered in models/registry.py)
SpecDerivation = Callable[[Mapping[str, Any], str], "ModelSpec"]

@dataclass(frozen=True)
class Biases:
    """Which linear projections add a bias: q/k/v (Qwen2, Llama's ``attention_bias``; Whisper has q and v
    only, which its model knows), the attention output, the MLP's."""

    qkv: bool = False
    o: bool = False
    mlp: bool = False


@dataclass(frozen=True)
class NormSpec:
    """The decoder's normalization: the epsilon of its RMSNorm (LayerNorm in BERT and Whisper), and whether
    q and k get a per-head RMSNorm too (Qwen3, Gemma 3, Qwen3-Next)."""

    eps: float = 1e-6
    qk: bool = False


@dataclass(frozen=True)
class RopeSpec:
    """The rotary embedding of the attention layers: its base and HF's ``rope_scaling`` variant (linear,
    llama3, yarn; ``layers/rotary.py``), or None for plain RoPE."""

    theta: float = 10000.0
    scaling: dict[str, Any] | None = None  # never mutated; a dict so the spec pickles


@dataclass(frozen=True)
class ModelSpec:
    """The model as every reader sees it: the common core of a decoder (sizes, heads, rope, windows, dtypes),
    its experts if it has any (``moe``) plus its family's own sub-spec (``family``), which also gives the
    terms where families differ (``models/family.py``)."""

    name: str
    architecture: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP width (0 when every layer is MoE and none is given)
    vocab: int
    tied: bool = False
    biases: Biases = Biases()  # which projections add a bias
    hidden_act: str = "silu"
    norm: NormSpec = NormSpec()  # the norms' epsilon, and q/k norms
    rope: RopeSpec = RopeSpec()
    max_position_embeddings: int | None = None
    # one entry per layer: the sliding window of that layer, or None for full attention
    layer_windows: tuple[int | None, ...] = ()
    # mixture of experts (models/moe_spec.py): the sparse layers, the experts and their routing; None = dense
    moe: MoESpec | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None  # the checkpoint's dtype as config.json states it
    # state-space / hybrid models: what each layer mixes with (MIXER_*); () = attention + MLP everywhere
    layer_mixers: tuple[str, ...] = ()
    # the family's own sub-spec and its terms (models/family.py: a ModelFamily; None or any other object: the
    # ordinary decoder's terms): SSMSpec, GDNSpec, DeepseekV4Spec, WhisperSpec, MLAFamily, GemmaSpec,
    # BertSpec, or one registered from outside forwardpass/ (docs/adding-a-model.md)
    family: Any = None

    def __post_init__(self) -> None:
        if not self.layer_windows:  # built by hand without windows: every layer attends to everything
            object.__setattr__(self, "layer_windows", (None,) * self.layers)
        elif len(self.layer_windows) != self.layers:
            raise ConfigError(f"layer_windows has {len(self.layer_windows)} entries for {self.layers} layers",
                              param="layer_types")
        windows = [w for w in self.layer_windows if w]
        if windows and self.max_position_embeddings and max(windows) > self.max_position_embeddings:
            raise ConfigError(f"sliding_window={max(windows)} is larger than max_position_embeddings="
                              f"{self.max_position_embeddings}", param="sliding_window")
        if self.layer_mixers and len(self.layer_mixers) != self.layers:
            raise ConfigError(f"layer_mixers has {len(self.layer_mixers)} entries for {self.layers} layers",
                              param="layers_block_type")
        if MIXER_MAMBA in self.layer_mixers and self.ssm is None:
            raise ConfigError("Mamba layers need the SSM sizes (ssm)", param="state_size")
        if MIXER_GDN in self.layer_mixers and self.gdn is None:
            raise ConfigError("Gated DeltaNet layers need their sizes (gdn)", param="linear_num_key_heads")

    @property
    def half_dtype(self) -> Any:
        """The checkpoint's ``torch.bfloat16`` / ``torch.float16`` where config.json says it is stored in one
        (what a float32 CPU engine keeps its weights and K/V in), else None."""
        import torch  # here: reading a spec needs no torch

        return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(self.torch_dtype or "")

    # ---- construction ----------------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], name: str = "") -> ModelSpec:
        """Build the spec from a config.json mapping (already un-nested from ``text_config``): the derivation
        registered for its architecture (else its model_type) in ``models/registry.py``, else
        ``decoder_spec``."""
        validate_config(cfg, name)  # typed bounds of every size (and checkpoint shapes) before any allocation
        from forwardpass.models.registry import spec_derivation  # the families' modules, imported when asked

        derive = spec_derivation(architecture(cfg), str(cfg.get("model_type") or ""))
        return (derive or decoder_spec)(cfg, name)

    # ---- the family's sub-spec, typed, for the family's own model code (nothing outside models/ reads these)
    def _family_as(self, attribute: str) -> Any:
        return self.family if getattr(self.family, "spec_attribute", None) == attribute else None

    @property
    def ssm(self) -> SSMSpec | None:
        """The Mamba2 mixer's sizes (Mamba2, Nemotron-H)."""
        return self._family_as("ssm")

    @property
    def gdn(self) -> GDNSpec | None:
        """The Gated DeltaNet sizes (Qwen3-Next)."""
        return self._family_as("gdn")

    @property
    def dsv4(self) -> DeepseekV4Spec | None:
        """DeepSeek-V4's compressed attention, hyper-connections and routing."""
        return self._family_as("dsv4")

    @property
    def mla(self) -> MLAFamily | None:
        """Multi-latent attention's sizes (DeepSeek-V2/V3)."""
        return self._family_as("mla")

    @property
    def whisper(self) -> WhisperSpec | None:
        """An encoder–decoder speech model's audio encoder."""
        return self._family_as("whisper")

    # ---- attention layout ------------------------------------------------------------------------
    def mixer(self, layer: int) -> str:
        """What ``layer`` mixes tokens with: MIXER_ATTENTION, MIXER_MAMBA or MIXER_MLP (none)."""
        return self.layer_mixers[layer] if self.layer_mixers else MIXER_ATTENTION

    @property
    def attention_layers(self) -> int:
        return sum(1 for i in range(self.layers) if self.mixer(i) == MIXER_ATTENTION)

    @property
    def mamba_layers(self) -> int:
        return sum(1 for i in range(self.layers) if self.mixer(i) == MIXER_MAMBA)

    @property
    def gdn_layers(self) -> int:
        return sum(1 for i in range(self.layers) if self.mixer(i) == MIXER_GDN)

    @property
    def sliding_window(self) -> int | None:
        """The window when every layer slides by the same one (Mistral); None otherwise."""
        windows = set(self.layer_windows)
        return next(iter(windows)) if len(windows) == 1 else None

    @property
    def is_moe(self) -> bool:
        """Some layer routes its MLP through experts."""
        return self.moe is not None and bool(self.moe.layer_ids)

    @property
    def moe_layers(self) -> int:
        return len(self.moe.layer_ids) if self.moe is not None else 0

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    # ---- parameter and byte counts: models/accounting.py (shared by the cost model and the analyzer) -----
    dense_layers = property(accounting.dense_layers)
    attention_params = property(accounting.attention_params)
    norm_params = property(accounting.norm_params)
    total_norm_params = property(accounting.total_norm_params)
    expert_params = property(accounting.expert_params)
    router_params = property(accounting.router_params)
    shared_expert_params = property(accounting.shared_expert_params)
    embedding_params = property(accounting.embedding_params)
    lm_head_params = property(accounting.lm_head_params)
    mixer_params = property(accounting.mixer_params)
    params = property(accounting.params)
    active_params = property(accounting.active_params)
    state_flops_per_token = property(accounting.state_flops_per_token)
    kv_bytes_per_token = accounting.kv_bytes_per_token
    state_bytes_per_sequence = accounting.state_bytes_per_sequence
    kv_positions = accounting.kv_positions
    unique_experts = accounting.unique_experts


# ---- the common core -----------------------------------------------------------------------------
def decoder_spec(cfg: Mapping[str, Any], name: str = "", *, qk_norm: bool = False, **given: Any) -> ModelSpec:
    """The spec of a decoder from the keys most families share (Llama's: ``hidden_size``,
    ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
    ``intermediate_size``, ``vocab_size``, the ``num_experts`` / ``num_local_experts`` MoE keys, rope,
    ``layer_types`` / ``use_sliding_window``, ...).

    A family's derivation passes what it resolves itself as ``given`` ModelSpec fields: those are taken as
    they are and their keys not read (Mamba2 gives its layers and heads, DeepSeek its MLA sizes and routing);
    any other field it adds (its sub-spec) goes into the spec too. ``qk_norm``: the family norms q and k per
    head (its configs do not say so; the epsilon is still the config's)."""
    f = dict(given)

    def need(key: str) -> Any:
        return require(cfg, key, name)

    def get(key: str, compute: Callable[[], Any]) -> Any:
        if key not in f:
            f[key] = compute()
        return f[key]

    hidden = get("hidden", lambda: int(need("hidden_size")))
    layers = get("layers", lambda: int(need("num_hidden_layers")))
    heads = get("heads", lambda: int(need("num_attention_heads")))
    kv_heads = get("kv_heads", lambda: int(cfg.get("num_key_value_heads") or heads))
    get("head_dim", lambda: int(cfg.get("head_dim") or hidden // heads))
    get("vocab", lambda: int(need("vocab_size")))
    arch = get("architecture", lambda: architecture(cfg))
    if heads % kv_heads:
        raise ConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}",
                          param="num_key_value_heads")
    moe = get("moe", lambda: moe_spec(cfg, layers, need))
    if "intermediate" not in f:
        f["intermediate"] = int(cfg.get("intermediate_size") or 0)
        if (len(moe.layer_ids) if moe else 0) < layers and f["intermediate"] <= 0:
            raise ConfigError(f"config {name} has dense layers but no 'intermediate_size'",
                              param="intermediate_size")
    if "rope" not in f:
        f["rope"] = RopeSpec(*rope_parameters(cfg))
    eps = cfg.get("rms_norm_eps")
    if eps is None:  # BERT names its LayerNorm epsilon layer_norm_eps; rms_norm_eps is "the norm's eps"
        eps = cfg.get("layer_norm_eps")
    max_pos = cfg.get("max_position_embeddings")
    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    attention_bias = bool(cfg.get("attention_bias", False))
    defaults = {
        "name": name or str(cfg.get("_name_or_path") or arch or "model"),
        "tied": bool(cfg.get("tie_word_embeddings", False)),
        "biases": Biases(qkv=attention_bias, o=attention_bias, mlp=bool(cfg.get("mlp_bias", False))),
        "hidden_act": str(cfg.get("mlp_hidden_act") or cfg.get("hidden_act") or cfg.get("hidden_activation")
                          or "silu"),
        "norm": NormSpec(float(eps if eps is not None else cfg.get("layer_norm_epsilon") or 1e-6), qk_norm),
        "max_position_embeddings": int(max_pos) if max_pos else None,
        "eos_token_ids": eos_token_ids(cfg),
        "torch_dtype": str(dtype) if dtype else None,
    }
    for key, value in defaults.items():
        f.setdefault(key, value)
    get("layer_windows", lambda: layer_windows(cfg, layers))
    return ModelSpec(**f)


def require(cfg: Mapping[str, Any], key: str, name: str = "") -> Any:
    """``cfg[key]``, or a ConfigError naming it."""
    value = cfg.get(key)
    if value is None:
        raise ConfigError(
            f"config {name or ''} has no {key!r}; a decoder needs hidden_size, num_hidden_layers, "
            "num_attention_heads, intermediate_size (or moe_intermediate_size) and vocab_size",
            param=key,
        )
    return value


def architecture(cfg: Mapping[str, Any]) -> str:
    """config.json's first ``architectures`` entry ("" when there is none)."""
    return str((cfg.get("architectures") or [""])[0])


def rope_parameters(cfg: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """transformers >= 5 writes one ``rope_parameters`` dict; older versions ``rope_theta`` plus an
    optional ``rope_scaling``. Both give (theta, scaling or None)."""
    theta = cfg.get("rope_theta")
    scaling = cfg.get("rope_scaling")
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping):
        theta = theta if theta is not None else params.get("rope_theta")
        if params.get("rope_type", "default") != "default" and not scaling:
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None and not isinstance(scaling, Mapping):
        raise ConfigError(f"rope_scaling must be an object, got {type(scaling).__name__}",
                          param="rope_scaling")
    return float(theta if theta is not None else 10000.0), (dict(scaling) if scaling else None)


def layer_windows(cfg: Mapping[str, Any], n: int) -> tuple[int | None, ...]:
    """Sliding window (or None) for each layer, from ``layer_types`` or Qwen's ``use_sliding_window`` +
    ``max_window_layers``, as HF does (Mistral's every-layer window: ``models/llama_spec.py``)."""
    window = cfg.get("sliding_window")
    window = int(window) if window else None
    types = cfg.get("layer_types")
    if types:
        if len(types) != n:
            raise ConfigError(
                f"config.json lists {len(types)} layer_types but num_hidden_layers is {n}; they must agree",
                param="layer_types",
            )
        unknown = sorted({str(t) for t in types if t not in LAYER_TYPES})
        if unknown:
            raise ConfigError(f"layer_types has unknown entries {unknown}; supported: {list(LAYER_TYPES)}",
                              param="layer_types")
        if SLIDING_ATTENTION in types and not window:
            raise ConfigError("layer_types lists sliding_attention layers but sliding_window is not set",
                              param="sliding_window")
        return tuple(window if t == SLIDING_ATTENTION else None for t in types)
    if cfg.get("use_sliding_window") and window:  # Qwen2/3: layers from max_window_layers on
        start = cfg.get("max_window_layers", n)
        return tuple(window if i >= start else None for i in range(n))
    return (None,) * n


def json_float(value: Any) -> float:
    """A float, also transformers' ``{"__float__": "Infinity"}`` encoding of a non-finite one."""
    if isinstance(value, Mapping):
        value = value.get("__float__")
    return float(value)


def opt_float(value: Any) -> float | None:
    return float(value) if value is not None else None


# ---- loading -------------------------------------------------------------------------------------
def load_model_spec(path: str | Path) -> ModelSpec:
    """The spec of the model in directory ``path`` (or of the config.json file ``path``), named after
    the directory."""
    return ModelSpec.from_config(load_model_config(path), name=model_name(path))


def model_name(path: str | Path) -> str:
    """A model's display name: its directory's name (also for a path to its config.json)."""
    path = Path(path)
    name = path.parent.name if path.is_file() else path.name
    return name or str(path)
