"""The toolkit's cache folder, one rule for every cache it keeps: the default data cache
(``data/``), demo tokenizers (``tokenizers/``), py-cpuinfo's answer (``cpuinfo/``) and DeepSpeed's
JIT-built ops (``torch_extensions/``, unless ``TORCH_EXTENSIONS_DIR`` is set)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$TOOLKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/toolkit``, else ``~/.cache/toolkit``."""
    if os.environ.get("TOOLKIT_CACHE_DIR"):
        return Path(os.environ["TOOLKIT_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "toolkit"
