"""Which weight paths an architecture can take, checked against the execution plan before its model is built.

The plan's weight methods (``layers/weight_methods.py``) reach a model only through the layers that read the
plan in their constructors: ``layers/linear.py::Linear``, a tied ``layers/embedding.py::TokenEmbedding``, MoE
expert stacks (``layers/moe.py::ExpertWeights``, ``models/expert_stacks.py``). An architecture built from
other layers would load in fp32 while the plan reports ``q8_0`` / ``q4_0`` weights
(``ExecutionPlan.describe``): it belongs in :data:`NOT_QUANTIZABLE`, and :func:`check_weight_path` refuses
such a plan, naming the architecture and the path. Every generating architecture is built from those layers
today (Whisper since its projections became ``Linear`` and its tied LM head a ``TokenEmbedding``), so the
table is empty; the check stays, so that a new family that is not yet says so instead of running fp32 under a
quantized name.

The packed fp32 path is not refused anywhere: it is what the plan picks by default wherever the compiled
kernels are loaded (``cpu_kernels="auto"`` once they are built), it changes no result, and a model whose
layers do not take it would keep plain fp32 weights on the paths it always used. The table of every
architecture × path is ``docs/weight-paths.md``; ``tests/test_weight_path_matrix.py`` runs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from forwardpass.errors import ConfigError
from forwardpass.quant import QUANTIZATIONS

if TYPE_CHECKING:
    from forwardpass.plan import ExecutionPlan


class _HasArchitecture(Protocol):
    architecture: str  # ModelSpec; ModelConfig (loader/config.py) has it as a property


#: architecture (config.json ``architectures``) → why the plan's quantized weight methods never reach it
NOT_QUANTIZABLE: dict[str, str] = {}


def check_weight_path(model: _HasArchitecture | str, plan: ExecutionPlan) -> None:
    """Raise ``ConfigError`` where ``model`` (a ``ModelSpec``, a ``ModelConfig`` or an architecture name)
    cannot take the weight path ``plan`` picks for its projections; return None where it can."""
    architecture = model if isinstance(model, str) else model.architecture
    fmt = plan.quantized_format
    reason = NOT_QUANTIZABLE.get(architecture) if fmt is not None else None
    if reason is None:
        return
    setting = next((name for name, f in QUANTIZATIONS.items() if f == fmt), fmt)
    raise ConfigError(
        f"{architecture} cannot take the {fmt} weight path (quantization={setting!r}): {reason}; "
        f"leave quantization unset for this model",
        param="quantization",
    )
