"""engine.hugepages: big CPU buffers advised to 2 MiB pages before their first write."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
import torch

from engine.hugepages import HUGE, advise_huge, huge_empty

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_kib_at(address: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process holding ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here")
def test_a_big_buffer_is_backed_by_huge_pages_once_written():
    t = huge_empty(8 * HUGE)
    t.fill_(1)
    assert huge_kib_at(t.data_ptr() + 4 * HUGE) >= 2048
    # not advised: 4 KiB pages where THP is madvise. A fresh mapping, not torch.empty: the heap
    # torch's allocator draws from may hold ranges that an earlier test advised (the advice stays
    # with the range after a free), which gave this buffer huge pages in one CI run
    m = mmap.mmap(-1, 8 * HUGE)
    plain = torch.frombuffer(m, dtype=torch.uint8)
    plain.fill_(1)
    if "[madvise]" in THP.read_text() and not os.environ.get("THP_MEM_ALLOC_ENABLE"):  # torch's own switch
        assert huge_kib_at(plain.data_ptr() + 4 * HUGE) == 0
    del plain
    m.close()


def test_buffers_without_a_whole_huge_page_are_left_alone():
    assert not advise_huge(torch.empty(HUGE // 2, dtype=torch.uint8))
    assert huge_empty(3, 5, dtype=torch.float32).shape == (3, 5)


@pytest.mark.parametrize("shape,dtype", [((3, 5), torch.float32), ((7, 4096), torch.uint8), ((2, 3, 1000), torch.bfloat16)])
def test_buffers_start_on_a_4k_page_for_o_direct_reads(shape, dtype):
    for _ in range(4):  # allocations of the same size land at different offsets from the heap
        t = huge_empty(*shape, dtype=dtype)
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % 4096 == 0
        t.fill_(1)  # the whole view is writable memory of its own
        assert t.float().sum().item() == t.numel()


@pytest.mark.parametrize("nbytes", [3 * 4096, 3 * HUGE + 4096])
def test_the_storage_starts_where_the_data_does(nbytes):
    """torch's is_pinned() (and a CUDA graph capture's check of a host buffer) looks up the
    storage's first byte: a buffer registered from its data pointer must not be the slice of a
    larger, unaligned storage (on an H200 the registered RAM tier read as unpinned for that)."""
    t = huge_empty(nbytes)
    assert t.untyped_storage().data_ptr() == t.data_ptr() and t.untyped_storage().nbytes() == nbytes
    assert t.data_ptr() % (HUGE if nbytes >= HUGE else 4096) == 0
