"""Weight-only quantization for CPU inference: block formats (Q8_0 / Q4_0), the quantize pass, and the
AVX2 kernel that multiplies fp32 activations by quantized weights (``csrc/quant_matmul.cpp``)."""

#: ``quantization=`` values (EngineConfig, ``--quantization``) → the block format of the linear weights
QUANTIZATIONS = {"int8": "q8_0", "int4": "q4_0"}
