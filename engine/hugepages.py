"""2 MiB pages for the big buffers a decode step streams every token: the expert cache's slots,
the RAM tier and the KV cache.

With 4 KiB pages a step that reads ~150 MB of weights walks ~37,000 pages per token (TLB misses,
and hardware prefetchers that stop at every 4 KiB boundary): one layer's 8 routed int4 experts of
the 1.3B test store, read cold from the slots, took 212-231 us with 4 KiB pages and 198-202 us
with huge ones (2-core EPYC, two runs each; a whole decoded token did not move beyond this
machine's run-to-run noise). Most kernels ship
transparent huge pages as ``madvise``: a range gets them only when asked. :func:`huge_empty`
asks for an uninitialised buffer before anything touches it, so its first writes fault in huge
pages. Where THP is off (``never``) or not Linux the advice is refused and nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap
import sys

import torch

HUGE = 2 << 20  # the x86-64 / arm64 transparent huge page
PAGE = 4096  # the alignment O_DIRECT needs of a buffer
MADV_HUGEPAGE = 14  # <sys/mman.h>


@functools.lru_cache(maxsize=1)
def _libc():
    """The C library (ctypes), or None off Linux or where it cannot be loaded."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


@functools.lru_cache(maxsize=1)
def libc_madvise():
    """libc's madvise(addr, length, advice) -> int, or None off Linux."""
    libc = _libc()
    if libc is None:
        return None
    f = libc.madvise
    f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    f.restype = ctypes.c_int
    return f


def return_freed_heap() -> None:
    """Give the pages of freed heap memory back to the OS (glibc ``malloc_trim``; elsewhere
    nothing). glibc keeps what a burst of large temporaries freed once its mmap threshold has
    risen (it rises with every large block freed): under a memory limit that memory still counts
    as ours. Converting the 1.3B bench store's dense weights left 60-150 MB of it, more or less
    from run to run as torch's threads picked their heaps (bench/beyond_ram.py, OOM-killed at a
    600 MB limit in one run of several)."""
    trim = getattr(_libc(), "malloc_trim", None)  # glibc's own: absent from other C libraries
    if trim is not None:
        trim(0)


def advise_huge(t: torch.Tensor) -> bool:
    """Ask for 2 MiB pages over the whole 2 MiB-aligned part of ``t``'s memory (before it is first
    written: pages already touched stay small). True if the kernel took the advice."""
    if t.device.type != "cpu":
        return False
    madvise = libc_madvise()
    start = -(-t.data_ptr() // HUGE) * HUGE
    end = (t.data_ptr() + t.numel() * t.element_size()) // HUGE * HUGE
    if madvise is None or end <= start:
        return False
    return madvise(start, end - start, MADV_HUGEPAGE) == 0


def huge_empty(*shape: int, dtype: torch.dtype = torch.uint8, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.empty(shape)`` whose CPU memory starts on a 4 KiB page (an O_DIRECT read can land
    in it: the expert cache's slots, engine.experts.tiers.HostTier.read_around) and is advised to
    2 MiB pages before its first write. It is a fresh private anonymous mapping, starting on a
    2 MiB boundary when it holds a huge page or more (malloc may hand back heap memory touched
    before, whose small pages stay small; a shared one would be shmem, whose huge pages are off
    by default), returned to the system when the tensor is freed; its storage starts where its
    data does."""
    if torch.device(device).type != "cpu":
        return torch.empty(*shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(*shape, dtype=dtype)
    # A mapping starts on a page; a huge one is over-allocated by a huge page to start on one.
    # The tensor's storage begins where its data does (frombuffer's offset, not a slice of a
    # larger storage): torch's is_pinned() looks up the storage's start, so a slice of a bigger
    # block registered from the slice's start (engine.experts.pinning) read as unpinned on an
    # H200, and torch refuses a copy from a host tensor it thinks unpinned inside a graph capture.
    mm = mmap.mmap(-1, nbytes + (HUGE if nbytes >= HUGE else 0), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    skip = (-torch.frombuffer(mm, dtype=torch.uint8, count=1).data_ptr()) % HUGE if nbytes >= HUGE else 0
    t = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=skip).view(dtype).view(*shape)
    advise_huge(t)
    return t
