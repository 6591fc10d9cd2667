"""Embeddings: an encoder's last hidden states pooled into one vector per input
(``LLM(model, task="embed")``)."""

from forwardpass.embed.outputs import EmbeddingOutput, EmbeddingRequestOutput

__all__ = ["EmbeddingOutput", "EmbeddingRequestOutput"]
