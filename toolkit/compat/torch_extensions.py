"""One folder of JIT-built ops (DeepSpeed's CPU Adam, FusedAdam, shm comm) per Python environment.

torch builds C++ extensions under ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions/
py311_cpu``, shared by every environment of that Python), and ninja rebuilds an extension whenever
its build command changes. The command names the environment's own torch include and library
folders, so two virtualenvs sharing the default folder rebuild each op (30-80 s on 2 cores, the
other ranks waiting on its lock) every time the other one built it last. Unless the user set
``TORCH_EXTENSIONS_DIR``, the toolkit gives each interpreter prefix its own folder, and each ninja
(the first on PATH, which torch runs): ninja 1.12+ hashes a build command differently from 1.11, so a
process with the environment's pip ninja on PATH (an activated venv) and one with the system's
(``.venv/bin/python -m toolkit``) each found the other's objects stale and rebuilt both ops (seen:
four to eight minutes per load on a loaded 2-core machine, ranks killed as hung in ``load``).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

from toolkit.storage.cache import cache_root


def extensions_dir() -> Path:
    """``cache_root()/torch_extensions/<env name>-<hash of sys.prefix and the ninja on PATH>``
    (``toolkit/storage/cache.py``)."""
    prefix = Path(sys.prefix).resolve()
    ninja = os.path.realpath(shutil.which("ninja") or "") if shutil.which("ninja") else ""
    tag = hashlib.sha256(str(prefix).encode() + (b"\0" + ninja.encode() if ninja else b"")).hexdigest()[:10]
    name = prefix.name.lstrip(".") or "env"  # a venv named .venv: a folder that ls shows
    return cache_root() / "torch_extensions" / f"{name}-py{sys.version_info[0]}{sys.version_info[1]}-{tag}"


def install() -> str:
    """Point ``TORCH_EXTENSIONS_DIR`` (read by torch at each build or load) at this environment's
    folder, unless it is set; returns the folder in use. Processes started afterwards inherit it."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))
    return os.environ["TORCH_EXTENSIONS_DIR"]
