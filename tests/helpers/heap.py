"""Whether glibc serves a block of a few MB from a mapping of its own (given back to the OS when
freed) or from its heap, read from ``mallinfo2`` (glibc >= 2.33): what ``toolkit/heap.py`` sets,
seen from inside a process."""
from __future__ import annotations

import ctypes
import json
import sys

MIB = 2**20
SIZES = (MIB, 6 * MIB, 16 * MIB)
"""Probed after a 24 MiB block was freed: with glibc's dynamic threshold all three now come from the
heap; with the toolkit's 4 MiB the two above it are mapped; with 8M only the 16 MiB one."""


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc():
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallInfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def mapped_blocks() -> dict[str, bool]:
    """{"1M": mapped?, "6M": mapped?, "16M": mapped?} in this process, after freeing a 24 MiB block
    (which raises a dynamic threshold above all three)."""
    libc = _libc()
    libc.free(libc.malloc(24 * MIB))
    found = {}
    for size in SIZES:
        before = libc.mallinfo2().hblkhd
        block = libc.malloc(size)
        found[f"{size // MIB}M"] = libc.mallinfo2().hblkhd - before >= size
        libc.free(block)
    return found


def kept_and_trimmed() -> dict[str, float]:
    """Anonymous MB as a streaming writer allocates: one tensor of a few MB after another, each freed
    while the next is alive. After the first multi-MB free, glibc's dynamic threshold serves such
    tensors from its heap, which gives pages back only from its top: the one still alive there holds
    every page below, until ``trim_heap``. Needs a process whose threshold was never fixed."""
    import torch

    from toolkit.heap import trim_heap
    first = torch.empty(2 << 20)  # 8 MiB: mmapped, and its free raises glibc's mmap threshold to it
    del first
    tensors = [torch.ones((2 << 20) - 1024) for _ in range(24)]  # just under 8 MiB each: from the heap
    held = _anonymous_mb()
    del tensors[:-1]  # the last one, on top of the heap, stays (the writer's current tensor)
    after_free = _anonymous_mb()
    trim_heap()
    return {"held": held, "after_free": after_free, "after_trim": _anonymous_mb()}


def _anonymous_mb() -> float:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Anonymous:")) / 1024


if __name__ == "__main__":  # a fresh process: "trim" (kept_and_trimmed), or apply the toolkit's setting and probe
    if sys.argv[1:] == ["trim"]:
        print(json.dumps(kept_and_trimmed()))
        sys.exit(0)
    from toolkit.heap import return_large_frees
    threshold = return_large_frees()
    print(json.dumps({"threshold": threshold, **mapped_blocks()}))
    sys.exit(0)
