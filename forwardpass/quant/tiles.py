"""The tile layout of a block-quantized weight, and back (the reference for ``csrc/tile_layout.h``).

Where our kernels multiply a weight at every batch size — the AVX-512 VNNI build (its small-batch kernel and
its GEMM) or the AVX2 build (its small-batch kernel; large batches dequantize it for a float GEMM), that is
everywhere but on AMX CPUs and the PyTorch reference — a :class:`~forwardpass.quant.weight.QuantizedWeight`
stores its values and scales in the tile layout instead of GGUF's: the same bytes and the same tensor shapes,
reordered inside each group of 16 rows so that one 64-byte load holds 4 consecutive k of 16 rows
(``csrc/tiles.h`` and ``csrc/tiles_avx2.h`` explain why). Rows ``16t .. 16t+R`` (R = 16, or ``N mod 16`` for
the last group) stay where they were; inside them, with ``k = 32b + c``:

* Q8_0 values: row r's ``c`` at ``((b·8 + c//4)·R + r)·4 + c%4``;
* Q4_0 values: the byte at ``((b·4 + c//8)·R + r)·4 + c%4`` (``c%8 < 4``) holds the 4-bit codes of ``c`` (low
  nibble) and ``c + 4`` (high);
* scales: ``d`` of (row r, block b) at ``b·R + r``.

Measured (0.6B model, a Zen 4 core pair, the two layouts alternated in one process, medians of 7-9 runs). VNNI
build: from cache the tile kernel computes 2x (Q8_0) and 2.4x (Q4_0) as fast as the GGUF-layout one; a batch-1
decode token, which streams the weights from memory, int8 22.0 -> 18.8 ms and int4 18.5 -> 15.9 ms; a
128-token prefill (the GEMM, whose per-call repacking becomes a vector copy) 324 -> 285 ms and 317 -> 296 ms.
AVX2 build (``FORWARDPASS_QUANT_ISA=avx2`` on the same CPU): a batch-1 decode token int8 47.4 -> 25.0 ms, int4
39.3 -> 18.5, batch-16 decode int8 16.2 -> 11.6 ms per token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

TILE = 16  # rows per tile: one AVX-512 register of int32 lanes (two AVX2 ones)


def _groups(fmt: str) -> int:
    """4-byte groups per block of 32 weights."""
    return 8 if fmt == "q8_0" else 4


def _rows_to_groups(qs: torch.Tensor, fmt: str) -> torch.Tensor:
    """GGUF rows ``[n, S]`` → ``[n, nb, groups, 4]`` bytes as the tile layout groups them."""
    n = qs.shape[0]
    if fmt == "q8_0":
        return qs.reshape(n, -1, 8, 4)
    b = qs.reshape(n, -1, 16)  # GGUF Q4_0: byte i holds codes i (low nibble) and i + 16 (high)
    codes = torch.cat([b & 0x0F, b >> 4], dim=-1).reshape(n, -1, 4, 2, 4)  # [n, nb, c//8, (c%8)//4, c%4]
    return codes[..., 0, :] | (codes[..., 1, :] << 4)


def _groups_to_rows(g: torch.Tensor, fmt: str) -> torch.Tensor:
    """The inverse of ``_rows_to_groups``: ``[n, nb, groups, 4]`` → GGUF rows ``[n, S]``."""
    n = g.shape[0]
    if fmt == "q8_0":
        return g.reshape(n, -1)
    codes = torch.stack([g & 0x0F, g >> 4], dim=-2).reshape(n, -1, 32)  # [n, nb, c]
    return (codes[..., :16] | (codes[..., 16:] << 4)).reshape(n, -1)


def _spans(n: int) -> list[tuple[int, int, int]]:
    """(first row, end row, rows per tile) of the runs of equal tiles among ``n`` rows: the full tiles, then
    the short last one."""
    full = n // TILE * TILE
    return ([(0, full, TILE)] if full else []) + ([(full, n, n - full)] if n > full else [])


def _per_span(
    qs: torch.Tensor, d: torch.Tensor, convert: Callable[..., tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``convert(q, d, tiles, rows)`` applied to every run of equal tiles of every matrix of
    ``qs [..., N, S]``, ``d [..., N, nb]``: new tensors of the same shapes."""
    shape_q, shape_d = qs.shape, d.shape
    q3, d3 = qs.reshape(-1, *shape_q[-2:]), d.reshape(-1, *shape_d[-2:])
    out_q, out_d = torch.empty_like(q3), torch.empty_like(d3)
    for i in range(q3.shape[0]):
        for start, stop, rows in _spans(shape_d[-2]):
            out_q[i, start:stop], out_d[i, start:stop] = convert(
                q3[i, start:stop], d3[i, start:stop], (stop - start) // rows, rows)
    return out_q.reshape(shape_q), out_d.reshape(shape_d)


def to_tiles(qs: torch.Tensor, d: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF-layout ``qs [..., N, S]``, ``d [..., N, nb]`` → the tile layout (new tensors, same shapes)."""

    def convert(q: torch.Tensor, dd: torch.Tensor, t: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        nb = dd.shape[-1]
        g = _rows_to_groups(q, fmt).reshape(t, rows, nb, _groups(fmt), 4)
        scales = dd.reshape(t, rows, nb).permute(0, 2, 1).reshape(dd.shape)
        return g.permute(0, 2, 3, 1, 4).reshape(q.shape), scales

    return _per_span(qs, d, convert)


def from_tiles(qs: torch.Tensor, d: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`to_tiles`."""

    def convert(q: torch.Tensor, dd: torch.Tensor, t: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        nb = dd.shape[-1]
        g = q.reshape(t, nb, _groups(fmt), rows, 4).permute(0, 3, 1, 2, 4)
        g = g.reshape(t * rows, nb, _groups(fmt), 4)
        return _groups_to_rows(g, fmt), dd.reshape(t, nb, rows).permute(0, 2, 1).reshape(dd.shape)

    return _per_span(qs, d, convert)


def _gather(
    qs: torch.Tensor, d: torch.Tensor, fmt: str, rel: torch.Tensor, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``rel`` (relative to the first) of a run of equal tiles of ``rows`` rows, in the GGUF layout."""
    nb = d.shape[-1]
    t, r = rel // rows, rel % rows
    g = qs.reshape(-1, nb, _groups(fmt), rows, 4)[t, :, :, r]  # [len(rel), nb, groups, 4]
    return _groups_to_rows(g, fmt), d.reshape(-1, nb, rows)[t, :, r]


def tile_rows(qs: torch.Tensor, d: torch.Tensor, fmt: str,
              ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``ids`` of a tile-layout matrix ``qs [N, S]``, ``d [N, nb]`` in the GGUF layout (an embedding
    lookup on a tied, quantized embedding: gathered, not the whole matrix converted)."""
    n, nb = d.shape
    ids = ids.reshape(-1).long()
    spans = _spans(n)
    if len(spans) == 1:  # N a multiple of 16 (most vocabularies), or under 16 rows: one gather
        return _gather(qs, d, fmt, ids, spans[0][2])
    out_q = torch.empty(ids.numel(), qs.shape[1], dtype=qs.dtype)
    out_d = torch.empty(ids.numel(), nb, dtype=d.dtype)
    for start, stop, rows in spans:
        sel = ((ids >= start) & (ids < stop)).nonzero().squeeze(-1)
        if sel.numel():
            out_q[sel], out_d[sel] = _gather(qs[start:stop], d[start:stop], fmt, ids[sel] - start, rows)
    return out_q, out_d
