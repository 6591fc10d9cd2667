"""Benchmarks: ``serve`` (online, against a running server). An offline throughput
benchmark can sit beside it."""
