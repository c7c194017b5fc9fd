"""The one table of on-disk checkpoint formats: how each is recognised, read, written and described.

``locate`` (``detect.py``) asks each format in ``FORMATS`` order whether a path holds it; the
``convert`` command writes through ``for_target(--to)``, and its ``--to`` choices and SRC help are
this table's. Adding a format is its module (its torch-free detection, a ``canonical.Source`` reader
and/or a ``write(source, out, request, progress) -> layout record``), one ``Format(...)`` line below,
and a case in tests/distributed/test_formats_table.py.

LoRA adapters (a toolkit LoRA checkpoint of either backend, an HF-PEFT directory, a DCP of a peft
model) are formats too, detected first: they convert only as a whole (``--to peft``, ``--to hf``
merged onto their base, or ``--to zero|megatron`` as the other backend's LoRA checkpoint), through
the functions of ``toolkit/lora/`` their line names, and their reader refuses to stream them.

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
from toolkit.formats.lora_checkpoint import describe_lora_checkpoint
from toolkit.formats.lora_megatron import find_megatron_lora
from toolkit.formats.lora_zero import find_zero_lora
from toolkit.formats.peft import describe_peft, describe_peft_dcp, find_peft_checkpoint, find_peft_dir
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
    help: str = ""
    """What it is, as the command line's SRC help and the unknown-format error list it."""
    lora_checkpoint: str | None = None
    """LoRA adapters: ``"module:function"``, ``function(found, base) -> LoraSource`` (adapters and
    moments, for ``--to zero|megatron``)."""
    lora_adapter: str | None = None
    """LoRA adapters: ``"module:function"``, ``function(found, base, hf_config) -> (Adapter, {format,
    step})`` (the peft model, for ``--to peft|hf`` and their ``--verify``)."""
    inspector: str | None = None
    """``"module:function"``, ``function(found, hf_config) -> dict``: ``toolkit inspect`` of a format
    that is not read as a stream (None: the generic one over its reader)."""

    @property
    def adapters(self) -> bool:
        """LoRA adapters only: converted whole, never streamed."""
        return self.lora_adapter is not None

    def open(self, folder: Path, hf_config: dict, extras: dict) -> Source:
        return _resolve(self.reader)(folder, hf_config, **extras)

    def write(self, source: Source, out: Path, request: WriteRequest, progress=None) -> dict:
        if self.writer is None:
            raise ConvertError(f"the {self.name} format is read only")
        return _resolve(self.writer)(source, out, request, progress)

    def open_lora_checkpoint(self, found, base: str | None):
        return _resolve(self.lora_checkpoint)(found, base)

    def open_adapter(self, found, base: str | None, hf_config: str | None = None):
        return _resolve(self.lora_adapter)(found, base, hf_config)

    def inspect(self, found, hf_config: str | None = None) -> dict:
        return _resolve(self.inspector)(found, hf_config)


def _hf(path: Path) -> Path | None:
    return path if is_hf_dir(path) else None


def _zero_native(path: Path) -> Path | None:
    tag = find_tag_dir(path)
    return tag if tag is not None and not is_universal(tag) else None


def _zero_universal(path: Path) -> Path | None:
    tag = find_tag_dir(path)
    return tag if tag is not None and is_universal(tag) else None


_LORA_CHECKPOINT = {"lora_checkpoint": "toolkit.lora.checkpoint:read_located",
                    "lora_adapter": "toolkit.lora.convert:adapter_of_checkpoint",
                    "inspector": "toolkit.lora.files:inspect_lora_checkpoint",
                    "help": "a toolkit LoRA checkpoint (ZeRO or megatron)"}
_DEEPSPEED = "a DeepSpeed checkpoint (global_stepN/ or the folder holding 'latest')"
FORMATS = (  # in the order ``locate`` tries them
    # LoRA adapters first: a LoRA checkpoint holds a backend's checkpoint, a peft DCP is a DCP directory
    Format("toolkit-deepspeed (LoRA)", find_zero_lora, "toolkit.formats.lora_checkpoint:whole_only", None,
           describe_lora_checkpoint, backend="deepspeed", **_LORA_CHECKPOINT),
    Format("toolkit-megatron (LoRA)", find_megatron_lora, "toolkit.formats.lora_checkpoint:whole_only", None,
           describe_lora_checkpoint, backend="megatron", **_LORA_CHECKPOINT),
    Format("dcp (peft LoRA)", find_peft_checkpoint, "toolkit.formats.peft:peft_dcp_whole_only", None, describe_peft_dcp,
           help="a PyTorch DCP of a peft LoRA model", lora_checkpoint="toolkit.lora.dcp:refuse_as_checkpoint",
           lora_adapter="toolkit.lora.dcp:adapter_of_dcp", inspector="toolkit.lora.dcp:inspect_located"),
    Format("peft", find_peft_dir, "toolkit.formats.peft:peft_whole_only", None, describe_peft, to="peft",
           help="an HF-PEFT adapter directory", lora_checkpoint="toolkit.lora.convert:peft_located_as_checkpoint",
           lora_adapter="toolkit.lora.convert:adapter_of_peft_dir", inspector="toolkit.lora.files:inspect_peft"),
    Format("hf", _hf, "toolkit.formats.hf:HFSource", "toolkit.formats.hf:write", describe_hf, to="hf",
           help="an HF save_pretrained directory"),
    Format("megatron", find_dist_dir, "toolkit.formats.megatron:MegatronSource", "toolkit.formats.megatron:write",
           describe_megatron, to="megatron", backend="megatron", help="a megatron-core torch_dist directory"),
    Format("megatron-legacy", find_legacy_dir, "toolkit.formats.megatron_legacy:LegacySource", None,
           describe_megatron_legacy, help="a Megatron-LM legacy mp_rank_XX checkpoint"),
    Format("zero", _zero_native, "toolkit.formats.zero:ZeroSource", None, describe_zero, backend="deepspeed",
           help=_DEEPSPEED),
    Format("zero-universal", _zero_universal, "toolkit.formats.zero:UniversalSource", "toolkit.formats.zero:write",
           describe_zero_universal, to="zero", backend="deepspeed", help=_DEEPSPEED),
    # after megatron: a torch_dist directory is a DCP directory too, told apart by its metadata.json
    # before dcp: a torchtitan checkpoint is a DCP directory under torchtitan's own parameter names
    Format("torchtitan", find_torchtitan_dir, "toolkit.formats.dcp:TorchtitanSource", None, describe_torchtitan,
           help="a torchtitan step-N/ checkpoint"),
    Format("dcp", find_dcp_dir, "toolkit.formats.dcp:DCPSource", "toolkit.formats.dcp_write:write", describe_dcp,
           to="dcp", help="a PyTorch distributed checkpoint (FSDP2: .metadata + *.distcp)"),
    Format("accelerate", find_accelerate_dir, "toolkit.formats.dcp:AccelerateSource",
           "toolkit.formats.dcp_write:write_accelerate", describe_accelerate, to="accelerate",
           help="an accelerate / HF Trainer FSDP checkpoint-N/"),
)
_MODELS_FIRST = sorted(FORMATS, key=lambda f: f.adapters)
TARGETS = tuple(f.to for f in _MODELS_FIRST if f.to)
"""What ``convert --to`` writes (``peft``: LoRA sources only)."""
SOURCES_HELP = ", ".join(dict.fromkeys(f.help for f in _MODELS_FIRST)) + ", or a toolkit run/checkpoint directory"
"""What ``convert`` and ``inspect`` read, for the command line's help and the unknown-format error."""


def by_name(name: str) -> Format:
    return next(f for f in FORMATS if f.name == name)


def backend_targets() -> tuple[str, ...]:
    """The ``--to`` names of a toolkit backend's checkpoint (a LoRA source converts to these as that
    backend's LoRA checkpoint)."""
    return tuple(f.to for f in FORMATS if f.to and f.backend)


def for_target(to: str) -> Format:
    """The format ``convert --to TO`` writes."""
    found = next((f for f in FORMATS if f.to == to), None)
    if found is None:
        raise ConvertError(f"--to {to!r}: choose one of {list(TARGETS)}")
    return found


def _resolve(ref: str):
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)
