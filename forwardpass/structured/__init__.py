"""Structured output: a request's text constrained to a JSON schema, regex, choice or grammar (xgrammar).

``StructuredOutputsParams`` (``params.py``) is the request's constraint, plain data inside
``SamplingParams``; ``GrammarBackend`` (``backend.py``) compiles it against the tokenizer once per
distinct constraint and keeps one matcher per sequence, whose token bitmask the sampler applies.
"""

from forwardpass.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
