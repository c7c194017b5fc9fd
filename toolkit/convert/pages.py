"""Give back the pages of a memory-mapped checkpoint once a tensor has been read from them.

A memory-mapped file's pages stay mapped (and count in the process's RSS) after they are read, so
reading every partition of a ZeRO checkpoint would end with the whole file resident.
``MADV_DONTNEED`` unmaps them now; they stay in the page cache, and a clean page of a private file
mapping is simply re-read on the next touch. On anonymous memory it would zero the data, so it is
applied only inside a mapping of a file (checked against /proc/self/maps). Linux; elsewhere a no-op.
"""
from __future__ import annotations

import bisect
import ctypes
import os
import sys

import torch

MADV_DONTNEED = 4
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_file_maps: list[tuple[int, int]] = []


def _read_file_maps() -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of regular files (inode != 0)."""
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[4] != "0" and parts[5].startswith("/"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                ranges.append((lo, hi))
    return sorted(ranges)


def _in_file_map(start: int, end: int) -> bool:
    global _file_maps
    for attempt in range(2):
        i = bisect.bisect_right(_file_maps, (start, float("inf"))) - 1
        if i >= 0 and _file_maps[i][0] <= start and end <= _file_maps[i][1]:
            return True
        if attempt == 0:
            _file_maps = _read_file_maps()
    return False


def release(t: torch.Tensor) -> None:
    """Unmap the pages under ``t`` (a view into a memory-mapped file); a no-op for anything else.
    Only whole pages inside ``t`` are released, so neighbouring data is never touched."""
    if _libc is None or t.numel() == 0:
        return
    start = -(-t.data_ptr() // _PAGE) * _PAGE
    end = (t.data_ptr() + t.nbytes) // _PAGE * _PAGE
    if end > start and _in_file_map(start, end):
        _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)
