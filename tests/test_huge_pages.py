"""Weights and KV caches moved onto 2 MB pages (forwardpass/engine/huge_pages.py): same values, same sharing."""

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
        self.embed = nn.Embedding(4096, 256)  # 4 MB: moved
        self.head = nn.Linear(256, 4096, bias=False)
        self.head.weight = self.embed.weight  # tied: one tensor
        self.small = nn.Linear(16, 16)  # under 2 MB: left
        self.register_buffer("table", torch.arange(1 << 20, dtype=torch.int32).view(1024, 1024))  # 4 MB...
        self.register_buffer("view", self.table[:512])  # ...that this buffer views half of: both stay


def test_model_tensors_move_with_their_values_and_sharing():
    torch.manual_seed(0)
    m = Tied()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    param, small_ptr, table_ptr = m.embed.weight, m.small.weight.data_ptr(), m.table.data_ptr()
    moved = huge_pages.move_model_to_huge_pages(m)
    assert moved == 4 << 20  # the embedding, once (tied)
    assert m.embed.weight is param and m.head.weight is m.embed.weight  # same Parameter, still tied
    assert m.embed.weight.data_ptr() % huge_pages.HUGE == 0
    assert m.small.weight.data_ptr() == small_ptr and m.table.data_ptr() == table_ptr == m.view.data_ptr()
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    x = torch.tensor([1, 2, 3])
    assert torch.equal(m.head(m.embed(x)), nn.functional.linear(before["embed.weight"][x], before["embed.weight"]))


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
