"""Memoize py-cpuinfo's ``get_cpu_info()`` for DeepSpeed's CPU op builders.

Each call of ``cpuinfo.get_cpu_info()`` starts a Python subprocess (about a second of CPU). DeepSpeed
asks it twice for every JIT-loaded CPU op (``-march`` and the SIMD width) and once more for
DeepSpeedCPUAdam, in every rank of every (re)start. The answer depends only on the machine, so it is
kept per process and on disk under ``cache_root()/cpuinfo/``, keyed by what identifies the CPU
(``/proc/cpuinfo``'s model name and flags, the platform and the Python version), never by anything
that changes between boots. A missing, unreadable or foreign entry is recomputed.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import sys
from pathlib import Path

from toolkit.storage.cache import cache_root

_installed = False


def cpu_identity() -> str:
    """A key that changes when the CPU (model, feature flags) or the interpreter changes."""
    lines = []
    try:
        with open("/proc/cpuinfo") as f:
            lines = sorted({line.strip() for line in f if line.startswith(("model name", "flags"))})
    except OSError:
        pass
    text = "\n".join([platform.machine(), platform.platform(), sys.version, *lines])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _cache_file() -> Path:
    return cache_root() / "cpuinfo" / f"{cpu_identity()}.json"


def _cached(compute):
    path = _cache_file()
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    info = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(info))
        tmp.replace(path)  # whole or absent: ranks writing at once never leave half a file
    except OSError:  # a read-only cache dir only costs the subprocess next time
        pass
    return info


def install() -> None:
    """Replace ``cpuinfo.get_cpu_info`` (looked up at call time by DeepSpeed) with the cached one."""
    global _installed
    if _installed:
        return
    try:
        import cpuinfo
    except ImportError:
        return
    original = cpuinfo.get_cpu_info
    cpuinfo.get_cpu_info = functools.cache(lambda: _cached(original))
    _installed = True
