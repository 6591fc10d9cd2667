"""One exception hierarchy for the whole package.

Every error a user can cause names the problem and, where there is one, the fix. The server maps
these to the OpenAI error envelope: ``ValidationError`` subclasses become 400, ``ModelNotFoundError``
404, ``QueueFullError`` 503 with Retry-After, everything else 500.
"""

from __future__ import annotations


class ForwardpassError(Exception):
    """Base class of every error raised on purpose by forwardpass."""

    #: OpenAI error "type" used by the server.
    error_type: str = "internal_error"
    #: HTTP status used by the server.
    status_code: int = 500

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


# ----- input validation (400) -------------------------------------------------------------------
class ValidationError(ForwardpassError, ValueError):
    """A request or configuration value is invalid (HTTP 400)."""

    error_type = "invalid_request_error"
    status_code = 400


class SamplingParamsError(ValidationError):
    """A sampling parameter is out of range."""


class ContextLengthError(ValidationError):
    """Prompt plus requested tokens do not fit the model's context window."""


class ConfigError(ValidationError):
    """An engine or pipeline configuration is impossible (e.g. KV budget too small)."""


# ----- model directories ------------------------------------------------------------------------
class ModelLoadError(ForwardpassError):
    """A model directory cannot be loaded."""

    error_type = "model_load_error"


class ModelNotFoundError(ModelLoadError):
    """The path does not exist or holds no model (HTTP 404 on the server)."""

    error_type = "not_found_error"
    status_code = 404


class MissingFileError(ModelLoadError):
    """A required file (config.json, weights, tokenizer.json, ...) is missing."""


class UnsupportedArchitectureError(ModelLoadError):
    """config.json names an architecture forwardpass does not implement."""


class UnsafeCheckpointError(ModelLoadError):
    """Only pickle checkpoints (*.bin, *.pt) were found; they are never unpickled."""


class UnsafeModelFileError(ModelLoadError):
    """A model file resolves outside its model directory (e.g. a symlink to /etc/passwd)."""


class CorruptWeightsError(ModelLoadError):
    """A safetensors file is truncated or malformed."""


class MissingTensorError(ModelLoadError):
    """A tensor the model needs is not in the checkpoint."""


class WeightShapeError(ModelLoadError):
    """A tensor in the checkpoint has the wrong shape for the config."""


class TokenizerError(ModelLoadError):
    """tokenizer.json / tokenizer_config.json is missing or unusable."""


class ChatTemplateError(ValidationError):
    """The chat template is missing or failed to render."""


# ----- serving ----------------------------------------------------------------------------------
class QueueFullError(ForwardpassError):
    """The engine's waiting queue is full; retry later (HTTP 503 + Retry-After)."""

    error_type = "server_overloaded"
    status_code = 503


class EngineDeadError(ForwardpassError):
    """The engine loop has died; no new requests can be served."""

    error_type = "engine_dead"
    status_code = 503


class EngineCrashedError(EngineDeadError):
    """The engine process died (killed by a signal, crashed) while this request ran in it (HTTP 500)."""

    status_code = 500


class EngineRestartingError(EngineDeadError):
    """The engine died and is being restarted; retry after ``retry_after_s`` (HTTP 503 + Retry-After)."""

    error_type = "engine_restarting"

    def __init__(self, message: str, *, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestTimeoutError(ForwardpassError):
    """The request did not finish within the server's per-request timeout (``--request-timeout``)."""

    error_type = "timeout_error"
    status_code = 504


class RequestAbortedError(ForwardpassError):
    """The request was aborted before it finished."""

    error_type = "request_aborted"
    status_code = 499
