"""Memory-mapped checkpoint files: give pages back after reading, and find a tensor's file bytes.

A memory-mapped file's pages stay mapped (and count in the process's RSS) after they are read, so
reading every partition of a ZeRO checkpoint would end with the whole file resident.
``MADV_DONTNEED`` unmaps them now; they stay in the page cache, and a clean page of a private file
mapping is simply re-read on the next touch. On anonymous memory it would zero the data, so it is
applied only inside a mapping of a file.

``toolkit.heap.trim_heap`` gives the C heap's free pages back (a writer that frees a tensor of
several MB after each one would otherwise keep growing; ``toolkit/heap.py`` says why, and holds the
mmap threshold ``toolkit convert`` fixes at its start). ``SourceMaps`` does the same for the mappings
of a source's files (safetensors maps each shard whole: every tensor read stayed resident).
Writers call both after each tensor (``give_back``).

``FileMaps`` is a snapshot of this process's file mappings (/proc/self/maps), taken by a reader
right after it has mapped its files and used only for tensors it holds: those mappings live as long
as the reader, so no entry it looks up can be stale. Linux; elsewhere every call is a no-op.
"""
from __future__ import annotations

import bisect
import ctypes
import os
import sys

import torch

from toolkit.heap import trim_heap

MADV_DONTNEED = 4
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


class FileMaps:
    def __init__(self):
        self.ranges: list[tuple[int, int, int, str]] = []
        """(start, end, file offset, path) of each mapping of a regular file (inode != 0)."""
        if _libc is None:
            return
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[4] != "0" and parts[5].startswith("/"):
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    self.ranges.append((lo, hi, int(parts[2], 16), parts[5].rstrip("\n")))
        self.ranges.sort()

    def _find(self, start: int, end: int):
        i = bisect.bisect_right(self.ranges, (start, float("inf"))) - 1
        if i >= 0 and self.ranges[i][0] <= start and end <= self.ranges[i][1]:
            return self.ranges[i]
        return None

    def location(self, t: torch.Tensor) -> tuple[str, int] | None:
        """(path, byte offset) of a contiguous tensor lying in a mapped file, so the kernel can copy
        its bytes file to file; None for anything else."""
        if t.numel() == 0 or not t.is_contiguous():
            return None
        found = self._find(t.data_ptr(), t.data_ptr() + t.nbytes)
        if found is None:
            return None
        start, _, offset, path = found
        return path, offset + t.data_ptr() - start

    def release(self, t: torch.Tensor) -> None:
        """Unmap the whole pages under ``t`` if it lies in a mapped file (neighbours untouched)."""
        if _libc is None or t.numel() == 0:
            return
        start = -(-t.data_ptr() // _PAGE) * _PAGE
        end = (t.data_ptr() + t.nbytes) // _PAGE * _PAGE
        if end > start and self._find(start, end) is not None:
            _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)


class SourceMaps:
    """The mappings of the files under ``root``, snapshot once (they live as long as the source
    that opened them): safetensors maps each shard whole, privately, when it is opened, and every
    page a read touches stayed in RSS - a whole HF model by the end of a write. The converter never
    writes into a source's tensors (every transform makes new ones), so these pages are all clean
    and unmapping them loses nothing: a later touch re-reads them from the page cache."""

    def __init__(self, root):
        self.ranges: list[tuple[int, int]] = []
        if _libc is None:
            return
        prefix = os.path.realpath(root) + os.sep
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[4] != "0" and parts[5].rstrip("\n").startswith(prefix):
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    self.ranges.append((lo, hi))

    def release(self) -> None:
        for lo, hi in self.ranges:
            _libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_DONTNEED)


def give_back(maps: SourceMaps | None = None) -> None:
    """After a writer is done with a tensor: the heap's free pages and the source's mapped file
    pages go back to the OS, so RSS stays within a few tensors of the process's floor."""
    trim_heap()
    if maps is not None:
        maps.release()
