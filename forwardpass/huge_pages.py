"""Weights and the KV cache on 2 MB pages (Linux transparent huge pages, asked for with ``madvise``).

Decode reads every weight and the whole live KV cache once per step, front to back. With 4 KB pages each page
is a TLB miss and, because the hardware prefetchers stop at page boundaries, a restart of the memory stream;
with 2 MB pages neither happens for 512 times as long. Measured on a Zen 4 core pair, 0.6B model: int8 batch-1
decode 34.9 -> 37.4 tok/s with only its 6 MB+ tensors moved; the paged-decode kernel over a DRAM-resident
cache +8%; a plain fp32 sum +5%.

Most Linux systems run transparent huge pages in ``madvise`` mode: memory gets them only where the process
asks, before the pages are first touched. So the model's tensors are moved by allocating a 2 MB-aligned
buffer, asking for huge pages on it, dropping whatever 4 KB pages malloc had already backed it with, then
copying. Until that last step was added (2026-12-02) a 0.6B int8 model had 44% of its weight bytes on huge
pages, not the 100% it has now, and an fp32 engine's KV cache none: after a model load most weight-sized
blocks come recycled from malloc's heap. Where the kernel has no huge pages (or this is not Linux) the copy is
plain memory, and nothing changes but the copy. ``FORWARDPASS_HUGE_PAGES=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import sys

import torch
from torch import nn

from forwardpass import envs

logger = logging.getLogger(__name__)

HUGE = 1 << 21  # bytes per page asked for
MADV_HUGEPAGE = 14  # <sys/mman.h>
MADV_DONTNEED = 4
MIN_BYTES = HUGE  # a model with fewer bytes than one huge page stays where it is
ALIGN = 64  # bytes: where each tensor starts in the shared buffer (a cache line, torch's own alignment)


def enabled() -> bool:
    return sys.platform == "linux" and envs.get("FORWARDPASS_HUGE_PAGES")


def _madvise(addr: int, nbytes: int, advice: int = MADV_HUGEPAGE) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), advice) == 0
    except (OSError, AttributeError):
        return False


def _released_as_huge(addr: int, nbytes: int) -> bool:
    """Ask for huge pages on ``[addr, addr + nbytes)`` (2 MB-aligned) and drop the pages it has now, so that
    the next touch faults in huge ones (madvise alone does not replace pages that exist); its bytes read as
    zeros until written. Whether both calls succeeded."""
    return _madvise(addr, nbytes) and _madvise(addr, nbytes, MADV_DONTNEED)


def empty_on_huge_pages(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose data starts on a 2 MB boundary, huge pages asked for (not yet
    touched, so the kernel can back it with them)."""
    return _empty_released(shape, dtype)[0]


def _empty_released(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """:func:`empty_on_huge_pages`, and how many of its first bytes were released (they read as zeros)."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + HUGE, dtype=torch.uint8)  # slack for the alignment
    offset = -raw.data_ptr() % HUGE
    # Released too, not only advised: malloc hands out recycled memory (glibc's mmap threshold rises to the
    # size of the last large block freed, up to 32 MB, so after a model load most weight-sized blocks come
    # from its heap, already backed by 4 KB pages). The tensor is uninitialised, so nothing is lost.
    released = nbytes // HUGE * HUGE
    if not _released_as_huge(raw.data_ptr() + offset, released):
        released = 0
    return raw[offset : offset + nbytes].view(dtype).view(shape), released  # the view keeps `raw` alive


def rebacked_on_huge_pages(t: torch.Tensor, chunk: int = 32 * HUGE) -> bool:
    """Put the memory of ``t`` (contiguous, already written, allocated by someone we cannot ask for huge
    pages, such as oneDNN's packed weights) on huge pages in place: ``chunk`` bytes at a time, the 2 MB pages
    inside its span are released and asked for again as huge pages, then their bytes are written back from a
    copy (so the extra memory is one chunk, not a second tensor). Returns whether any were."""
    nbytes = t.numel() * t.element_size()
    start = t.data_ptr()
    lo = -(-start // HUGE) * HUGE
    hi = (start + nbytes) // HUGE * HUGE
    if not enabled() or not t.is_contiguous() or t.device.type != "cpu" or hi <= lo:
        return False
    raw = t.reshape(-1).view(torch.uint8)
    with torch.no_grad():
        for at in range(lo, hi, chunk):
            size = min(chunk, hi - at)
            part = raw[at - start : at - start + size]
            saved = part.clone()
            if not _released_as_huge(at, size):
                return False  # nothing released (or the bytes are still there): leave it as it is
            part.copy_(saved)  # released pages read back as zeros until this
    return True


def zeros_on_huge_pages(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros on huge pages. Only the bytes not released are written: released pages read as zeros already, and
    writing them would touch the whole of a KV cache at start-up (a 1 GB default: a second or two of every
    engine's start, and all its memory taken before a request needs it)."""
    t, released = _empty_released(shape, dtype)
    t.view(-1).view(torch.uint8)[released:].zero_()
    return t


def _whole(t: torch.Tensor) -> bool:
    """``t`` is its storage, all of it (not a view into a larger one)."""
    nbytes = t.numel() * t.element_size()
    return t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == nbytes


def move_model_to_huge_pages(model: nn.Module) -> int:
    """Move the parameters and buffers of ``model`` into one buffer on huge pages, back to back in module
    order, in place (parameters stay the same Parameter objects; a tensor two modules share, such as a tied
    embedding, stays shared; a storage that some tensor only views part of stays where it is, so no view is
    cut off from it; so do the tensors of a module that marks them ``keeps_own_memory``, views of memory
    another library owns). Returns how many bytes moved.

    One buffer rather than one per tensor: a tensor of its own is 2 MB-aligned, but its last partial page (and
    a tensor under 2 MB, such as a quantized weight's scales) would sit on 4 KB pages; a 0.6B int8 model had
    9% of its bytes there. Back to back, only the buffer's end can be partial. Measured on a Zen 4 core pair:
    summing 112 buffers of that model's layer-weight sizes, one parallel region each, 1.10x faster with whole
    pages than with 4 KB-page tails; its batch-1 decode 1.026x (int8, 40 alternating pairs) and 1.045x (int4)
    against one buffer per tensor. The copy is made tensor by tensor, each old one freed as its users move, so
    memory grows by about one tensor at a time, not by the model."""
    if not enabled():
        return 0
    # storage address -> (module, name, is parameter)
    slots: dict[int, list[tuple[nn.Module, str, bool]]] = {}
    for module in model.modules():
        if getattr(module, "keeps_own_memory", False):
            continue
        for kind, table in ((True, module._parameters), (False, module._buffers)):
            for name, t in table.items():
                if t is not None and t.device.type == "cpu":
                    slots.setdefault(t.untyped_storage().data_ptr(), []).append((module, name, kind))
    # users, tensor, offset, size
    chosen: list[tuple[list[tuple[nn.Module, str, bool]], torch.Tensor, int, int]] = []
    end = moved = 0
    for users in slots.values():
        views = [getattr(m, n) for m, n, _ in users]
        first = views[0]
        if not all(_whole(v) and v.shape == first.shape and v.dtype == first.dtype for v in views):
            continue
        offset, nbytes = -(-end // ALIGN) * ALIGN, first.numel() * first.element_size()
        chosen.append((users, first, offset, nbytes))
        end, moved = offset + nbytes, moved + nbytes
    if end < MIN_BYTES:
        return 0
    arena = empty_on_huge_pages((-(-end // HUGE) * HUGE,), torch.uint8)  # whole pages: the end is advised too
    with torch.no_grad():
        for users, first, offset, nbytes in chosen:
            new = arena[offset : offset + nbytes].view(first.dtype).view(first.shape).copy_(first)
            for module, name, is_param in users:
                if is_param:
                    getattr(module, name).data = new  # the same Parameter object, new memory
                else:
                    module._buffers[name] = new
    logger.info("%.0f MB of weights on huge pages", moved / 1e6)
    return moved
