"""Shared building blocks: every model file is assembled from these."""
