"""Weights and KV caches moved onto 2 MB pages (forwardpass/huge_pages.py): same values, same sharing."""

import ctypes
import mmap
import sys

import pytest
import torch
from torch import nn

from forwardpass import huge_pages


def test_buffers_start_on_a_huge_page_boundary():
    z = huge_pages.zeros_on_huge_pages((3, 1 << 19), torch.float32)
    assert z.data_ptr() % huge_pages.HUGE == 0 and z.shape == (3, 1 << 19) and not z.any()
    e = huge_pages.empty_on_huge_pages((5, 7), torch.int8)  # smaller than a page: still a valid tensor
    assert e.shape == (5, 7) and e.dtype == torch.int8 and e.is_contiguous()


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(4096, 256)  # 4 MB
        self.head = nn.Linear(256, 4096, bias=False)
        self.head.weight = self.embed.weight  # tied: one tensor
        self.small = nn.Linear(16, 16)  # small tensors move too: weight 1 KB, bias 64 bytes
        self.register_buffer("table", torch.arange(1 << 20, dtype=torch.int32).view(1024, 1024))  # 4 MB...
        self.register_buffer("view", self.table[:512])  # ...that this buffer views half of: both stay
        self.register_buffer("halves", torch.zeros(3, dtype=torch.float16))  # 6 bytes; the next starts 64 on


def test_model_tensors_move_into_one_buffer_with_their_values_and_sharing():
    torch.manual_seed(0)
    m = Tied()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    param, table_ptr = m.embed.weight, m.table.data_ptr()
    moved = huge_pages.move_model_to_huge_pages(m)
    # the embedding once (tied), the small Linear, `halves`
    assert moved == (4 << 20) + 16 * 16 * 4 + 16 * 4 + 6
    assert m.embed.weight is param and m.head.weight is m.embed.weight  # same Parameter, still tied
    # back to back in module order (the root module's own tensors first), each on a cache line, in one storage
    # starting on a huge page
    moved_tensors = [m.halves, m.embed.weight, m.small.weight, m.small.bias]
    storage, base = m.halves.untyped_storage(), m.halves.data_ptr()
    assert base % huge_pages.HUGE == 0
    assert all(t.untyped_storage().data_ptr() == storage.data_ptr() for t in moved_tensors)
    assert [t.data_ptr() - base for t in moved_tensors] == [0, 64, 64 + (4 << 20), 64 + (4 << 20) + 1024]
    assert storage.data_ptr() + storage.nbytes() - base >= 6 << 20  # whole pages, the last one too
    assert m.table.data_ptr() == table_ptr == m.view.data_ptr()
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    x = torch.tensor([1, 2, 3])
    assert torch.equal(m.head(m.embed(x)),
                       nn.functional.linear(before["embed.weight"][x], before["embed.weight"]))


class OwnMemory(nn.Module):
    keeps_own_memory = True  # e.g. a view of memory another library allocated (layers/packed.py)

    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.ones(1 << 20))


def test_modules_that_keep_their_own_memory_and_tiny_models_stay():
    m = nn.Sequential(OwnMemory(), nn.Linear(1024, 1024))
    ptr = m[0].buf.data_ptr()
    assert huge_pages.move_model_to_huge_pages(m) == 1024 * 1024 * 4 + 1024 * 4 and m[0].buf.data_ptr() == ptr
    tiny = nn.Linear(4, 4)  # under one huge page in all: not worth a buffer of its own
    ptr = tiny.weight.data_ptr()
    assert huge_pages.move_model_to_huge_pages(tiny) == 0 and tiny.weight.data_ptr() == ptr


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


def _huge_fraction(addr: int, nbytes: int) -> float | None:
    """AnonHugePages of the mapping that holds ``addr``, as a fraction of ``nbytes``; None
    where smaps does not say."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line: "start-end perms ..."
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1]) * 1024 / nbytes
    return None


@pytest.mark.skipif(sys.platform != "linux" or _thp_mode() != "madvise",
                    reason="no huge pages asked for here")
def test_memory_already_on_4k_pages_gets_huge_pages_once_released():
    # What empty_on_huge_pages does to the blocks malloc hands out: recycled ones already have their 4 KB
    # pages, which madvise alone leaves in place (0% of this span became huge that way, 100% once released).
    size = 16 << 20
    block = mmap.mmap(-1, size + huge_pages.HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # ours alone
    block.write(b"x" * len(block))  # every page touched: 4 KB pages, as in a block malloc recycles
    addr = ctypes.addressof(ctypes.c_char.from_buffer(block))
    start = addr + (-addr % huge_pages.HUGE)
    assert huge_pages._released_as_huge(start, size)
    ctypes.memset(start, 1, size)  # touched again: faults in huge pages
    assert block[start - addr] == 1 and block[start - addr - 1] == ord("x")  # the span alone was released
    fraction = _huge_fraction(start, size)
    if fraction is None:
        pytest.skip("/proc/self/smaps reports no AnonHugePages")
    assert fraction >= 0.75  # most of it; the system may lack a free huge page for the rest


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("FORWARDPASS_HUGE_PAGES", "0")
    m = Tied()
    ptr = m.embed.weight.data_ptr()
    assert huge_pages.move_model_to_huge_pages(m) == 0 and m.embed.weight.data_ptr() == ptr


def test_memory_already_written_is_rebacked_in_place_with_its_values():
    t = torch.randn(3 << 20, generator=torch.Generator().manual_seed(1))  # 12 MB, not 2 MB-aligned in general
    before, ptr = t.clone(), t.data_ptr()
    huge_pages.rebacked_on_huge_pages(t, chunk=2 * huge_pages.HUGE)  # several chunks (False where no THP)
    assert t.data_ptr() == ptr and torch.equal(t, before)
    small = torch.randn(100)  # no whole huge page inside it: left as it is
    assert not huge_pages.rebacked_on_huge_pages(small)
