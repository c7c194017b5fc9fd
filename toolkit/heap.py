"""The C heap of a toolkit process: freed tensors of a few MB go back to the OS (glibc; elsewhere a no-op).

Why. glibc serves an allocation above its mmap threshold (128 KiB at first) with a mapping of its own,
unmapped when freed; but the first such free raises the threshold to that block's size (its "dynamic"
threshold, up to 32 MiB on 64-bit). From then on every tensor below it, a ``[tokens, hidden]`` fp32
activation of 8,192 tokens and hidden 512 is 16 MiB, comes from the heap, and a heap gives pages back
only from its top: transients freed between long-lived activations stay resident and are reused only
by blocks that fit. A training rank at long sequences holds gigabytes that way (Llama hidden 512, 4
layers, 16,384 tokens, ZeRO-2, ``zero.sp=2``: 1.6 GB of free heap still held after a step, and the
step's RSS growth 0.61x of DP2's where its saved activations are 0.52x; fixed: 0.52x, and 40 MB held),
so long sequences look unscaled and host-side runs (CPU, offload) run out sooner.

``return_large_frees`` fixes the threshold (``mallopt(M_MMAP_THRESHOLD)``, which also turns the dynamic
raise off): every block of ``DEFAULT_MMAP_THRESHOLD`` or more is a mapping of its own, unmapped on
free. Smaller blocks (most Python objects, small tensors) keep the heap's speed; the price of the
large ones is an mmap/munmap and fresh pages the kernel zeroes per allocation: on a CPU run, where
the activations are host memory, about 10% of a step at 8,192 tokens per rank (2.3x the page faults;
``benchmarks/host_memory.py``, docs/long-context.md#host-memory). Every rank calls it first thing
(``train/worker.py``), and so does ``toolkit convert``.

``THRESHOLD_ENV`` (``TOOLKIT_MMAP_THRESHOLD``) tunes it for a process: a size in bytes (``4194304``,
``4M``, ``512K``, ``8MiB``), at most glibc's 32 MiB; ``0`` or ``off`` keeps glibc's dynamic threshold.
``trim_heap`` returns the heap's free pages now (``malloc_trim``), for code that frees many blocks
below the threshold (the converter's writers, after each tensor).
"""
from __future__ import annotations

import ctypes
import os
import re
import sys
from typing import Mapping

from toolkit.config import ConfigError

THRESHOLD_ENV = "TOOLKIT_MMAP_THRESHOLD"
DEFAULT_MMAP_THRESHOLD = 4 * 2**20
"""4 MiB: a [tokens, hidden] fp32 tensor from 2,048 tokens at hidden 512 up is mapped; 128 MiB of
4 MiB blocks is 32 mappings (glibc allows 65,536, Linux ~65,530 per process)."""
MAX_MMAP_THRESHOLD = 32 * 2**20
"""glibc's ceiling on 64-bit (HEAP_MAX_SIZE / 2); ``mallopt`` refuses more."""
_M_MMAP_THRESHOLD = -3  # malloc.h
_OFF = ("0", "off", "false", "no", "none")
_UNITS = {"": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20}

_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_mallopt = getattr(_libc, "mallopt", None)
_trim = getattr(_libc, "malloc_trim", None)


def mmap_threshold(env: Mapping[str, str] = os.environ) -> int | None:
    """The threshold ``env`` asks for (``THRESHOLD_ENV``; unset: ``DEFAULT_MMAP_THRESHOLD``), None for
    glibc's own; a value that is no size raises ``ConfigError`` naming the variable and the fix."""
    raw = env.get(THRESHOLD_ENV, "").strip()
    if not raw:
        return DEFAULT_MMAP_THRESHOLD
    if raw.lower() in _OFF:
        return None
    found = re.fullmatch(r"(\d+)\s*([a-z]*)", raw.lower())
    if found is None or found.group(2) not in _UNITS:
        raise ConfigError(f"{THRESHOLD_ENV}={raw!r} is not a size: give bytes (4194304) or K/M/MiB (4M, 8MiB), "
                          "or 0/off to keep glibc's dynamic mmap threshold")
    size = int(found.group(1)) * _UNITS[found.group(2)]
    if not 0 < size <= MAX_MMAP_THRESHOLD:
        raise ConfigError(f"{THRESHOLD_ENV}={raw!r} is {size:,} bytes, above glibc's limit of {MAX_MMAP_THRESHOLD:,} "
                          "(32M); choose a threshold up to 32M, or 0/off to keep glibc's dynamic one")
    return size


def return_large_frees(env: Mapping[str, str] = os.environ) -> int | None:
    """Fix glibc's mmap threshold at ``mmap_threshold(env)`` for this process (the module docstring says
    why); returns the threshold set, None when off or not glibc. Process-wide and not undone: call it
    at a process's start (a rank, a command), not from a library function."""
    threshold = mmap_threshold(env)
    if threshold is None or _mallopt is None:
        return None
    if _mallopt(ctypes.c_int(_M_MMAP_THRESHOLD), ctypes.c_int(threshold)) != 1:
        raise RuntimeError(f"glibc's mallopt refused M_MMAP_THRESHOLD={threshold}")
    return threshold


def trim_heap() -> None:
    """Return the C heap's free pages to the OS now (glibc's ``malloc_trim``; elsewhere a no-op).

    Why a streaming writer needs it even below the threshold: the megatron writer's RSS grew by
    100-150 MB over a 340-tensor write (``benchmarks/convert.py``), ~90% of it free heap between
    long-lived small objects. ``malloc_trim`` releases every free page, not only the top ones; it
    costs a walk over the heap's free chunks (tens of microseconds here)."""
    if _trim is not None:
        _trim(0)
