"""Storage sizes of the dtypes the analyzer understands."""

from __future__ import annotations

from forwardpass.errors import ConfigError

#: Bytes per element. int4 is packed two per byte; quantization scales/zero-points are not counted
#: (for group-128 fp16 scales they add ~3% to int4 and ~1.6% to int8 weights).
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5,
}

_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "f32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "f16": "fp16",
    "float8": "fp8",
    "fp8_e4m3": "fp8",
    "e4m3": "fp8",
    "q8": "int8",
    "q4": "int4",
}


def normalize_dtype(name: str, *, what: str = "dtype", allowed: tuple[str, ...] | None = None) -> str:
    """Canonical dtype name (``"bfloat16"`` → ``"bf16"``), or :class:`ConfigError` naming the choices."""
    key = str(name).strip().lower()
    key = _ALIASES.get(key, key)
    choices = allowed or tuple(DTYPE_BYTES)
    if key not in choices:
        raise ConfigError(f"unknown {what} {name!r}; choose one of: {', '.join(choices)}", param=what)
    return key


def dtype_bytes(name: str) -> float:
    return DTYPE_BYTES[normalize_dtype(name)]
