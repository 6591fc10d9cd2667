"""Bottleneck analysis: which resource (FLOP/s or bytes/s) limits a model on a given accelerator.

- :mod:`~forwardpass.analysis.hardware` — accelerator spec table plus a measured ``this-machine``.
- :mod:`~forwardpass.analysis.roofline` — per-operation FLOPs and bytes from a config, prefill and decode
  totals (:func:`analyze`).
- :mod:`~forwardpass.analysis.attention` — naive vs fused attention kernel traffic.
- :mod:`~forwardpass.analysis.diffusion` — DiT denoiser cost per step.
- :mod:`~forwardpass.analysis.plot` / :mod:`~forwardpass.analysis.report` — roofline PNG and rich tables.

Predicted against measured on this machine needs the engine, which stands above this package:
:mod:`forwardpass.explain.measure`. Nothing here imports torch at module import time; only the
``this-machine`` microbenchmark does.
"""

from __future__ import annotations
