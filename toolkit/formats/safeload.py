"""Pickles are data, never code: ``torch.load(weights_only=True)`` with an explicit allowlist.

DeepSpeed and Megatron checkpoints hold a few classes besides tensors and containers; those, and
only those, are allowed here. Anything else is refused with the class named and how to opt in.
"""
from __future__ import annotations

import importlib
import pickle
import re
import zipfile
from pathlib import Path

from toolkit.formats.errors import ConvertError


class Fields:
    """Stand-in for a small object a checkpoint holds (LossScaler, fragment_address): keeps its
    fields, runs none of its code, and needs no import of the library that defined it."""

    def __setstate__(self, state):
        self.__dict__.update(state if isinstance(state, dict) else {"state": state})

    def __repr__(self):
        return f"Fields({self.__dict__})"


def _enum_value(value):
    """Stand-in for an Enum class called with its value (``ZeroStageEnum(3)``): the value."""
    return value


STAND_INS = {
    "deepspeed.runtime.zero.config.ZeroStageEnum": _enum_value,      # optim_states: zero_stage
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": Fields,         # optim_states: loss_scaler
    "deepspeed.utils.tensor_fragment.fragment_address": Fields,      # stage 1/2 param_slice_mappings
    "argparse.Namespace": Fields,                                    # Megatron-LM legacy files: args
}
"""The classes DeepSpeed and Megatron-LM checkpoints legitimately hold besides tensors and
containers, each read as plain data (megatron-core's torch_dist files hold none). Nothing else is
allowed: a legacy file's numpy RNG state, for one, is refused unless trusted explicitly."""

TRUST_ENV = "TOOLKIT_TRUST_PICKLE_CLASSES"


def _resolve(qualname: str):
    module, _, name = qualname.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None  # not installed: a file that names it is refused like any foreign class


def _allowed(extra: tuple[str, ...] = ()) -> list:
    """The allowlist for torch's weights_only unpickler: stand-ins by name, plus classes the user
    trusts explicitly (imported, and then really constructed)."""
    trusted = [c for c in (_resolve(q) for q in extra) if c is not None]
    return [(fn, name) for name, fn in STAND_INS.items()] + trusted


def trusted_extra() -> tuple[str, ...]:
    """Classes the user explicitly trusts: ``TOOLKIT_TRUST_PICKLE_CLASSES=mod.Class,mod.Other``."""
    import os
    return tuple(c.strip() for c in os.environ.get(TRUST_ENV, "").split(",") if c.strip())


def safe_load(path: Path, mmap: bool = True):
    """``torch.load`` of a checkpoint file with weights_only=True and the allowlist; memory-mapped
    (tensors are read from disk only when touched). Refusals and damage get their own messages."""
    import torch  # here, not at the top: torchzip reads STAND_INS without importing torch
    path = Path(path)
    if not path.is_file():
        raise ConvertError(f"{path}: file is missing; the checkpoint is incomplete (copy it again, or convert "
                           "another checkpoint)")
    _check_zip(path)
    try:
        with torch.serialization.safe_globals(_allowed(trusted_extra())):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        raise _refusal(path, exc) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile) as exc:
        raise ConvertError(f"{path}: cannot be read ({str(exc).splitlines()[0]}); the file is truncated or "
                           "corrupted") from None


def _check_zip(path: Path) -> None:
    """torch.save files are zip archives: a truncated one has lost its central directory."""
    if not zipfile.is_zipfile(path):
        raise ConvertError(f"{path}: not a complete torch.save archive ({path.stat().st_size} bytes; the file is "
                           "truncated or not a checkpoint file)")


# How torch's weights_only unpickler (torch/_weights_only_unpickler.py, 2.6 to 2.13) names what it refused:
_BLOCKED = re.compile(r"GLOBAL ([\w.]+) whose module ([\w.]+) is blocked")  # os, sys, posix, nt: never loadable
_NOT_ALLOWED = re.compile(r"GLOBAL ([\w.]+) was not an allowed global")      # allowable by name
_OTHER = (re.compile(r"GLOBAL ([\w.]+)"), re.compile(r"<(?:class|function) '?([\w.]+)'?"))


def refused_global(exc: Exception) -> tuple[str | None, bool]:
    """(the global torch's weights_only unpickler refused, whether it is blocked outright) from its
    message; (None, False) when the message names none."""
    text = str(exc)
    if found := _BLOCKED.search(text):
        return found.group(1), True
    for pattern in (_NOT_ALLOWED, *_OTHER):
        if found := pattern.search(text):
            return found.group(1), False
    return None, False


def _refusal(path: Path, exc: Exception) -> ConvertError:
    name, blocked = refused_global(exc)
    if blocked:
        return ConvertError(f"{path}: refusing to unpickle {name}: a function of a module torch never loads from a "
                            "checkpoint (it runs commands); no checkpoint holds it: do not use this file")
    if name is None:  # torch's own words, first line, rather than a guess
        detail = next((line.strip() for line in str(exc).splitlines() if "WeightsUnpickler error" in line),
                      str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return ConvertError(f"{path}: refusing to unpickle it: {detail}; unpickling could run code (do not trust "
                            "this file)")
    return ConvertError(
        f"{path}: refusing to unpickle {name}: it is not one of the classes a DeepSpeed or Megatron checkpoint "
        f"holds, and unpickling it could run code. If you trust this file, allow the class explicitly: "
        f"{TRUST_ENV}={name} toolkit convert ...")
