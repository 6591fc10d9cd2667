"""Every message between the async front end and the engine loop, as frozen dataclasses.

The same objects cross the thread transport (a ``queue.Queue``) and the process transport (a
``multiprocessing`` queue and pipe, pickled); both sides dispatch on them with ``match``. Events are
sent in lists, one list per loop turn, so a step's outputs cost one message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from forwardpass.engine.scheduling.batch import TokenDelta
from forwardpass.engine.scheduling.stats import StepRecord
from forwardpass.errors import ForwardpassError
from forwardpass.lora.request import LoRARequest
from forwardpass.sampling.params import SamplingParams

if TYPE_CHECKING:
    from forwardpass.models.model_spec import ModelSpec


# ----- front end -> engine loop ---------------------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_request: LoRARequest | None
    arrival_time: float
    encoder_input: Any = None  # encoder–decoder models (Whisper): the request's log-mel features, a tensor


@dataclass(frozen=True)
class Abort:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class StopSamples:
    """Samples that a stop string ended in the front end: ``(request id, sample index)``."""

    samples: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class DebugRequest:
    call_id: int


@dataclass(frozen=True)
class BlockMapRequest:
    """Ask for the KV block map (``introspect.block_map``) for the dashboard; answered by a ``DebugReply``."""

    call_id: int


@dataclass(frozen=True)
class Shutdown:
    pass


EngineCommand = AddRequest | Abort | StopSamples | DebugRequest | BlockMapRequest | Shutdown


# ----- engine loop -> front end ---------------------------------------------------------------------
@dataclass(frozen=True)
class EngineInfo:
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    default_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    max_num_seqs: int
    #: the engine's plan and weights (``layers/weight_report.py::described_plan``, plain JSON values):
    #: reported by ``/v1/models``
    execution_plan: dict[str, Any] = field(default_factory=dict)
    #: the model as the engine loaded it: the server reads it here, not again from config.json
    model_spec: ModelSpec | None = None


@dataclass(frozen=True)
class Ready:
    info: EngineInfo


@dataclass(frozen=True)
class StartupFailed:
    error: ForwardpassError


@dataclass(frozen=True)
class Admitted:
    """The answer to ``AddRequest``: accepted (``error`` None) or refused with the validation error."""

    request_id: str
    error: ForwardpassError | None = None


@dataclass(frozen=True)
class StepOutput:
    deltas: tuple[TokenDelta, ...]
    record: StepRecord


@dataclass(frozen=True)
class RequestsFailed:
    request_ids: tuple[str, ...]
    error: ForwardpassError


@dataclass(frozen=True)
class Snapshot:
    """Gauges of an idle engine (a step's record carries them while it runs)."""

    num_running: int
    num_waiting: int
    kv_usage: float
    num_free_blocks: int


@dataclass(frozen=True)
class DebugReply:
    call_id: int
    result: dict[str, Any] | ForwardpassError


@dataclass(frozen=True)
class EngineDead:
    reason: str


@dataclass(frozen=True)
class Stopped:
    pass


EngineEvent = (
    Ready
    | StartupFailed
    | Admitted
    | StepOutput
    | RequestsFailed
    | Snapshot
    | DebugReply
    | EngineDead
    | Stopped
)


def portable(exc: BaseException) -> ForwardpassError:
    """An exception that pickles and that the server maps to an error envelope."""
    if isinstance(exc, ForwardpassError):
        return exc
    return ForwardpassError(f"engine fault: {type(exc).__name__}: {exc}")
