"""GGUF files requantized by llama.cpp itself (llama-cpp-python's ``llama_model_quantize``): the K-quant
presets real files are made with (Q4_K_M, Q5_K_M, ...), which the ``gguf`` package cannot write."""

from __future__ import annotations

from pathlib import Path


def requantize(src: Path, dst: Path, ftype: str, *, allow_requantize: bool = True) -> Path:
    """``dst``: ``src`` quantized to llama.cpp's preset ``ftype`` ("Q4_K_M", "Q6_K", "IQ4_NL", ...)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.allow_requantize = allow_requantize
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize {src} -> {ftype} failed ({rc})")
    return dst
