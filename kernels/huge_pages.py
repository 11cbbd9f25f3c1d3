"""Copies of tensors in one anonymous mapping that Linux is asked to back with 2 MB pages.

A batch-1 decode step streams every weight once: a gigabyte for Gemma 3 in fp32, 260,000 pages
of 4 KB to translate, or 512 of 2 MB. On the AMD EPYC this project measures on (under a
hypervisor), decode ran 1.01-1.23x faster with the weights in 2 MB pages, by model and dtype
(docs/benchmarks.md, "2 MB pages for the weights a decode step streams"; `python -m bench.huge_pages`).
Linux gives an anonymous mapping huge pages where `madvise(MADV_HUGEPAGE)` asks for them and
/sys/kernel/mm/transparent_hugepage/enabled is `madvise` or `always` (most distributions); torch
asks for none, and the engine's weights often come mapped from their safetensors file, where
none apply.

Where the OS has no such advice (macOS) or refuses it, the copies live in ordinary pages of the
same mapping: the same values, read the same way.
"""
from __future__ import annotations

import ctypes
import mmap
from collections.abc import Sequence

import torch
from torch import Tensor

HUGE_PAGE = 2 << 20
ALIGN = 64  # each copy starts on a cache line, as torch's own allocations do


def huge_page_copies(tensors: Sequence[Tensor], advise: bool = True) -> list[Tensor]:
    """Contiguous copies of `tensors`, one after another from a 2 MB boundary in one mapping,
    advised MADV_HUGEPAGE before any page is touched where `advise` and the OS has the advice.
    The mapping lives as long as any copy does; its pages beyond the copies are never touched,
    so they take no memory."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // ALIGN) * ALIGN
    if not end:
        return [t.clone() for t in tensors]
    # a huge page more than the copies need, to start them on a 2 MB boundary wherever it lands
    area = mmap.mmap(-1, end + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if advise and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            area.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel built without transparent huge pages: ordinary pages
            pass
    whole = torch.frombuffer(area, dtype=torch.uint8)  # holds `area` open while any view of it lives
    start = -whole.data_ptr() % HUGE_PAGE
    copies = []
    for t, offset, size in zip(tensors, offsets, sizes):
        copy = whole[start + offset:start + offset + size].view(t.dtype).view(t.shape)
        copies.append(copy.copy_(t))
    return copies


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim; elsewhere nothing): the
    copies replaced were freed into the heap, which glibc otherwise keeps for the process."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)
