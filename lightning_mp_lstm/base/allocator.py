"""Freed host memory goes back to the operating system, so that a process's peak is what it held at once.

PyTorch's CPU tensors come from the C library's ``malloc``. glibc serves an allocation above its *mmap threshold*
from its own mapping and unmaps it when freed, but raises the threshold (up to 32 MiB) whenever such a block is
freed: after that, tensors of a few MiB come from the heap, and a heap keeps what is freed in its middle. A pipeline
rank that builds its blocks, times copies of them and runs microbatches of several sizes then holds freed memory on
top of its live memory (70-120 MiB per rank on MXNet's 8 x 1024 model under pp4, measured with
``benchmarks/memory.py``), and its peak is no longer what the memory plan predicts. :func:`return_freed_memory` fixes
the threshold instead (``mallopt(M_MMAP_THRESHOLD)``, which also stops its adjustment): every allocation from 1 MiB up
is mapped on its own and returned when freed. Smaller ones, the bulk of a small model's tensors, are unaffected.

Only while the blocks are built, timed and planned: mapping every tensor of 1 MiB or more afresh costs the training
steps a page fault per page of each one (a one-process step of MXNet's 8 x 400 model took 0.42 s instead of 0.30 s).
Once the blocks are built the strategy raises the threshold to :data:`STEADY_MMAP_THRESHOLD` (glibc's own upper
bound) where the memory plan leaves room (:func:`steady_threshold`): a step's tensors below it then come back from
the heap freed by the step before. The heap keeps what a step needed at once, so a process holds more than its live
tensors (pp4 ranks of MXNet's 8 x 1024 model 70-170 MiB more, ``benchmarks/memory.py``); where the plan's peak is
close to the budget, every tensor of 1 MiB or more is still returned.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["MMAP_THRESHOLD", "ROOM", "STEADY_MMAP_THRESHOLD", "freed_memory_returned", "leaves_little_room",
           "return_freed_memory", "steady_threshold"]

#: Allocations from this many bytes up are mapped on their own (and unmapped when freed), while the blocks are built.
MMAP_THRESHOLD = 1 << 20
#: The same once the blocks are built and the steps run, where the memory plan leaves room.
STEADY_MMAP_THRESHOLD = 32 << 20
#: The share of the budget a process's predicted peak may reach for the steps to keep freed memory in the heap.
ROOM = 0.75


def steady_threshold(peak: int | None, budget: int | None, sharded: bool = False) -> int:
    """The threshold for the training steps: :data:`STEADY_MMAP_THRESHOLD` unless the predicted ``peak`` is above
    :data:`ROOM` of the ``budget`` or the replicas shard (then :data:`MMAP_THRESHOLD`: nothing freed is kept); unknown
    ones leave room.

    Sharded replicas gather and scatter a block's tensors at every step, in buffers of shifting sizes. Kept in the
    heap, what they freed grew for 16 steps (MXNet's 8 x 1024 model, dp2): 2,474 MiB per rank against a plan of
    1,216 MiB. With every buffer of 1 MiB or more returned it stayed at 1,340 MiB, for steps 1.29x slower. The same
    model replicated peaks 24-27 % above its plan with the heap kept, 9 % above with it returned.
    """
    return MMAP_THRESHOLD if leaves_little_room(peak, budget) or sharded else STEADY_MMAP_THRESHOLD


def leaves_little_room(peak: int | None, budget: int | None) -> bool:
    """Whether a predicted ``peak`` is above :data:`ROOM` of the ``budget`` (unknown ones leave room)."""
    return peak is not None and budget is not None and peak > ROOM * budget


_M_MMAP_THRESHOLD = -3  # glibc's <malloc.h>


def return_freed_memory(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes in this process (Linux with glibc only); left alone when the
    environment sets ``MALLOC_MMAP_THRESHOLD_`` (the user chose). Returns whether it was set."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)  # glibc's; musl has none
    return bool(mallopt is not None and mallopt(_M_MMAP_THRESHOLD, int(threshold)))


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, found once (``find_library`` runs ``ldconfig`` in a process of its own)."""
    for name in ("libc.so.6", None):
        try:
            return ctypes.CDLL(name or ctypes.util.find_library("c"))
        except (OSError, TypeError):
            continue
    return None


@contextmanager
def freed_memory_returned() -> Iterator[bool]:
    """Run with every allocation from :data:`MMAP_THRESHOLD` up mapped afresh, as sharded replicas' steps run (to time
    what that costs: a page fault per page of each such tensor); after it the threshold is
    :data:`STEADY_MMAP_THRESHOLD` (glibc has no way to read the one before, and its own adjustment stops at that
    bound). Yields whether the threshold could be set (not where ``MALLOC_MMAP_THRESHOLD_`` is set: the user chose)."""
    changed = return_freed_memory(MMAP_THRESHOLD)
    try:
        yield changed
    finally:
        if changed:
            return_freed_memory(STEADY_MMAP_THRESHOLD)
