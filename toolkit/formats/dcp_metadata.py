"""A PyTorch distributed checkpoint's ``.metadata``, unpickled with an allowlist.

Why: ``torch.distributed.checkpoint.FileSystemReader.read_metadata`` is a bare ``pickle.load``, so a
``.metadata`` file from an untrusted source could run any code when DCP opens it (a PyTorch DCP
directory, and megatron-core's torch_dist format, which is one). ``load_metadata``
unpickles it here instead, with ``find_class`` answering only DCP's own metadata classes, torch
dtypes / layouts / memory formats, ``torch.Size`` and paths, and hands the result to the reader
(which then never unpickles the file itself). Any other global (``os.system``, ``builtins.eval``)
is refused before anything is called: of ``torch``'s own names only its dtypes, layouts and memory
formats pass (``torch.save``, ``torch.load`` or ``torch.from_file`` would write or read any file).
The pure-Python unpickler is used because its ``BUILD`` can be guarded: it may set the fields of a
fresh instance of DCP's metadata classes (``_BUILT``) and of nothing else, so a pickle cannot set
attributes on a class, a function, an enum member or a dtype (that would rewrite DCP's or torch's
own objects for the rest of the process).
"""
from __future__ import annotations

import functools
import importlib
import pickle
from pathlib import Path

from toolkit.formats.errors import ConvertError

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    # megatron-core's torch_dist saves keep every rank's save plan in ``Metadata.all_local_plans``
    "torch.distributed.checkpoint.planner": ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"),
    "torch.serialization": ("_get_layout",),
    "torch": ("Size",),
    "pathlib": ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"),  # storage_meta.checkpoint_id
    "collections": ("OrderedDict",),
}
"""Every global a ``.metadata`` written by ``torch.distributed.checkpoint`` names (torch 2.x), directly or
through megatron-core's ``dist_checkpointing`` (the megatron format's reader vets it too)."""

_BUILT = {"torch.distributed.checkpoint.metadata": ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                                    "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                                    "StorageMeta"),
          "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
          "torch.distributed.checkpoint.planner": ("SavePlan", "WriteItem", "TensorWriteData")}
"""The classes whose fresh instances a ``BUILD`` may fill (DCP's metadata dataclasses, pickled as an
empty instance and its fields): the only ``BUILD`` targets DCP's own pickles have."""


class _VettingUnpickler(pickle._Unpickler):
    """Allowlisted globals only; BUILD only on an instance of ``_BUILT``'s classes, with field names."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str):
        import torch
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                          torch.memory_format)):
            return getattr(torch, name)  # a dtype named by attribute (TensorProperties' fields)
        raise _Refused(f"{module}.{name}")

    def _load_build(self):
        target, state = self.stack[-2], self.stack[-1]
        kind = type(target)
        if kind not in _built_classes():
            what = getattr(target, "__qualname__", None) or f"a {kind.__module__}.{kind.__qualname__}"
            raise _Refused(f"setting attributes on {what!r}")
        if not hasattr(kind, "__setstate__") and not _plain_fields(state):  # else the class's own __setstate__
            raise _Refused(f"setting {state!r:.80} on a {kind.__qualname__}")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _load_build


def _plain_fields(state) -> bool:
    """A dict of field names (or pickle's (dict, slots) pair of them): no ``__class__``, no ``__dict__``."""
    parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
    return all(part is None or isinstance(part, dict) and all(isinstance(k, str) and not k.startswith("__")
                                                              for k in part) for part in parts)


@functools.cache
def _built_classes() -> frozenset[type]:
    return frozenset(getattr(importlib.import_module(module), name) for module, names in _BUILT.items()
                     for name in names)


class _Refused(Exception):
    pass


def load_metadata(folder: Path):
    """The ``Metadata`` of a DCP directory, unpickled through the allowlist; a clear refusal otherwise."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
    path = Path(folder) / ".metadata"
    try:
        with open(path, "rb") as f:
            metadata = _VettingUnpickler(f).load()
    except _Refused as exc:
        raise ConvertError(f"{path}: refusing to unpickle {exc}: a torch.distributed.checkpoint .metadata holds "
                           "only DCP's metadata classes, torch dtypes and sizes, and unpickling anything else "
                           "could run code; this file was not written by torch.distributed.checkpoint alone "
                           "(do not trust it)") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, KeyError) as exc:
        raise ConvertError(f"{path}: not a readable DCP .metadata ({type(exc).__name__}: {exc}); the file is "
                           "truncated or damaged") from None
    if not isinstance(metadata, Metadata):
        raise ConvertError(f"{path}: holds a {type(metadata).__name__}, not DCP's Metadata")
    if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
        metadata.storage_meta = StorageMeta()
    return metadata
