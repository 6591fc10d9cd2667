"""LoRA's error type, in a module without torch so the CLI can import it cheaply."""

from forwardpass.errors import ValidationError


class LoRAAdapterError(ValidationError):
    """A LoRA adapter cannot be used with this engine or model (HTTP 400)."""
