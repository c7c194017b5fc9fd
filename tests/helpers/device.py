"""Strict device mode probes: code run as if it were a toolkit module (strict mode tells toolkit code
apart by its module name)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from toolkit import device


def as_toolkit_code(source: str) -> dict:
    """Run ``source`` as if it were a toolkit module; its globals afterwards."""
    scope = {"__name__": "toolkit._strict_probe", "torch": torch, "dist": dist, "device": device}
    exec(compile(source, "toolkit/_strict_probe.py", "exec"), scope)
    return scope
