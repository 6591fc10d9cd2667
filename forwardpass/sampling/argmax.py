"""The greedy token of each row of logits, fast on CPU: numpy's vectorised argmax.

On a 49k vocabulary (SmolLM2) one Sapphire Rapids core takes ~60 us for ``torch.argmax`` of a row, ~21 us
for ``max(-1).indices`` and ~3 us for numpy's ``argmax`` (an AVX-512 / AVX2 loop chosen by the CPU's flags).
A greedy decode step takes one row per sequence, a verify step one per draft: 0.3 ms of a 15-row verify of
that model went here. Same answer as torch: the first of equal maxima, NaN counted as the largest
(``tests/test_greedy_argmax.py``). Other devices and dtypes keep torch's ``max``.
"""

from __future__ import annotations

import numpy as np
import torch


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``argmax`` over the last dimension (int64; a 0-d tensor for one row)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        return logits.max(-1).indices
    return torch.from_numpy(np.asarray(logits.detach().numpy().argmax(-1), dtype=np.int64))
