"""The one table of on-disk checkpoint formats: how each is recognised, read, written and described.

``locate`` (``detect.py``) asks each format in ``FORMATS`` order whether a path holds it; the
``convert`` command writes through ``for_target(--to)``. Adding a format is its module (a
``canonical.Source`` reader and/or a ``write(source, out, request, progress) -> layout record``),
one ``Format(...)`` line below, and a case in tests/distributed/test_formats_table.py.

Detection stays torch-free (the direct ZeRO -> HF route decides with it before any reader is
imported): ``detect`` and the table itself import no torch; ``reader`` and ``writer`` are named
``"module:attribute"`` and imported when used.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from toolkit.formats.describe import (
    describe_accelerate,
    describe_dcp,
    describe_hf,
    describe_megatron,
    describe_megatron_legacy,
    describe_torchtitan,
    describe_zero,
    describe_zero_universal,
    find_accelerate_dir,
    find_dcp_dir,
    find_dist_dir,
    find_legacy_dir,
    find_torchtitan_dir,
)
from toolkit.formats.errors import ConvertError
from toolkit.formats.hf import is_hf_dir
from toolkit.formats.zero_index import find_tag_dir, is_universal

if TYPE_CHECKING:
    from toolkit.formats.canonical import Source, WriteRequest


@dataclass(frozen=True)
class Format:
    """One on-disk checkpoint format: a line of ``FORMATS``."""
    name: str
    """As ``locate`` and ``inspect`` report it."""
    detect: Callable[[Path], Path | None]
    """The folder its reader opens when ``path`` holds this format, else None (torch-free)."""
    reader: str
    """``"module:Class"`` of its ``canonical.Source``: ``Class(folder, hf_config, **extras)``."""
    writer: str | None
    """``"module:function"`` writing a source in this format: ``write(source, out, request,
    progress) -> layout record`` (None: read only)."""
    describe: Callable[[Path], dict]
    """The layout record a checkpoint of this format carries (its writer's request read back)."""
    to: str | None = None
    """The ``convert --to`` name of its writer."""
    backend: str | None = None
    """The toolkit backend that trains from it: its checkpoints lie under a toolkit checkpoint's
    ``engine/`` beside meta.json and trainer.json."""

    def open(self, folder: Path, hf_config: dict, extras: dict) -> Source:
        return _resolve(self.reader)(folder, hf_config, **extras)

    def write(self, source: Source, out: Path, request: WriteRequest, progress=None) -> dict:
        if self.writer is None:
            raise ConvertError(f"the {self.name} format is read only")
        return _resolve(self.writer)(source, out, request, progress)


def _hf(path: Path) -> Path | None:
    return path if is_hf_dir(path) else None


def _zero_native(path: Path) -> Path | None:
    tag = find_tag_dir(path)
    return tag if tag is not None and not is_universal(tag) else None


def _zero_universal(path: Path) -> Path | None:
    tag = find_tag_dir(path)
    return tag if tag is not None and is_universal(tag) else None


FORMATS = (  # in the order ``locate`` tries them
    Format("hf", _hf, "toolkit.formats.hf:HFSource", "toolkit.formats.hf:write", describe_hf, to="hf"),
    Format("megatron", find_dist_dir, "toolkit.formats.megatron:MegatronSource", "toolkit.formats.megatron:write",
           describe_megatron, to="megatron", backend="megatron"),
    Format("megatron-legacy", find_legacy_dir, "toolkit.formats.megatron_legacy:LegacySource", None,
           describe_megatron_legacy),
    Format("zero", _zero_native, "toolkit.formats.zero:ZeroSource", None, describe_zero, backend="deepspeed"),
    Format("zero-universal", _zero_universal, "toolkit.formats.zero:UniversalSource", "toolkit.formats.zero:write",
           describe_zero_universal, to="zero", backend="deepspeed"),
    # after megatron: a torch_dist directory is a DCP directory too, told apart by its metadata.json
    # before dcp: a torchtitan checkpoint is a DCP directory under torchtitan's own parameter names
    Format("torchtitan", find_torchtitan_dir, "toolkit.formats.dcp:TorchtitanSource", None, describe_torchtitan),
    Format("dcp", find_dcp_dir, "toolkit.formats.dcp:DCPSource", "toolkit.formats.dcp_write:write", describe_dcp,
           to="dcp"),
    Format("accelerate", find_accelerate_dir, "toolkit.formats.dcp:AccelerateSource",
           "toolkit.formats.dcp_write:write_accelerate", describe_accelerate, to="accelerate"),
)
TARGETS = tuple(f.to for f in FORMATS if f.to)
"""What ``convert --to`` writes."""


def by_name(name: str) -> Format:
    return next(f for f in FORMATS if f.name == name)


def for_target(to: str) -> Format:
    """The format ``convert --to TO`` writes."""
    found = next((f for f in FORMATS if f.to == to), None)
    if found is None:
        raise ConvertError(f"--to {to!r}: choose one of {list(TARGETS)}")
    return found


def _resolve(ref: str):
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)
