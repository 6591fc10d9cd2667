"""Weights and KV caches moved onto 2 MB pages (forwardpass/engine/huge_pages.py): same values, same sharing."""

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from forwardpass.engine import huge_pages


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
    assert moved == (4 << 20) + 16 * 16 * 4 + 16 * 4 + 6  # the embedding once (tied), the small Linear, `halves`
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
    assert torch.equal(m.head(m.embed(x)), nn.functional.linear(before["embed.weight"][x], before["embed.weight"]))


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


_RECYCLED = """
import ctypes, sys, torch
from forwardpass.engine import huge_pages
libc = ctypes.CDLL(None)
libc.mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD: blocks under 64 MB from malloc's heap, as after a model load
libc.mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD: and freed ones kept there
size = 16 << 20
used = torch.ones((size + huge_pages.HUGE) // 4)  # its pages touched, then freed into the heap
del used
e = huge_pages.empty_on_huge_pages((size // 4,), torch.float32)  # gets that block back
e.fill_(2.0)
assert e.data_ptr() % huge_pages.HUGE == 0 and float(e[-1]) == 2.0
with open("/proc/self/smaps") as f:  # AnonHugePages of the mapping that holds e
    inside = False
    for line in f:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= e.data_ptr() < hi
        elif inside and head == "AnonHugePages:":
            print(int(line.split()[1]) * 1024 / size)
            sys.exit(0)
print("unknown")
"""


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


@pytest.mark.skipif(sys.platform != "linux" or _thp_mode() not in ("always", "madvise"), reason="no huge pages here")
def test_fresh_buffers_are_backed_by_huge_pages_even_where_malloc_recycles_memory():
    # malloc hands out blocks freed earlier with their 4 KB pages still backed, and madvise alone leaves those
    # (about half of this buffer stayed on 4 KB pages before empty_on_huge_pages dropped them first). In a
    # process of its own: the check changes malloc's settings.
    env = {**os.environ, "FORWARDPASS_HUGE_PAGES": "1"}
    out = subprocess.run([sys.executable, "-c", _RECYCLED], check=False, capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    if out.stdout.strip() == "unknown":
        pytest.skip("/proc/self/smaps reports no AnonHugePages")
    assert float(out.stdout) >= 0.75  # most of it; the system may lack a free huge page for the rest


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
