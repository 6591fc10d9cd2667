"""The cache kinds of compressed attention (DeepSeek-V4), defined next to its model
(``models/deepseek_v4_cache_spec.py``): sliding K=V pages (``SharedKVSlidingSpec``), compressed entries paged
by entry index (``CompressedSpec``, with its own metadata builder) and the compressor's state slot.
Re-exported here for the engine's readers; ``DeepseekV4Attention.kv_cache_spec`` declares them."""

from forwardpass.models.deepseek_v4_cache_spec import CompressedSpec, SharedKVSlidingSpec, layer_cache_specs

__all__ = ["CompressedSpec", "SharedKVSlidingSpec", "layer_cache_specs"]
