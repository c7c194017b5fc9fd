"""A PyTorch distributed checkpoint's ``.metadata``, unpickled with an allowlist.

Why: ``torch.distributed.checkpoint.FileSystemReader.read_metadata`` is a bare ``pickle.load``, so a
``.metadata`` file from an untrusted source could run any code when DCP opens it (a PyTorch DCP
directory, and megatron-core's torch_dist format, which is one). ``load_metadata``
unpickles it here instead, with ``find_class`` answering only DCP's own metadata classes, torch
dtypes / layouts / memory formats, ``torch.Size`` and paths, and hands the result to the reader
(which then never unpickles the file itself). Any other global (``os.system``, ``builtins.eval``)
is refused before anything is called. The pure-Python unpickler is used because its ``BUILD``
can be guarded: a pickle may not set attributes on a class or a function (that would rewrite
DCP's or torch's own code objects for the rest of the process).
"""
from __future__ import annotations

import pickle
import types
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


class _VettingUnpickler(pickle._Unpickler):
    """Allowlisted globals only; BUILD refused on classes, functions and modules."""

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
        target = self.stack[-2]
        if isinstance(target, (type, types.FunctionType, types.BuiltinFunctionType, types.ModuleType)):
            raise _Refused(f"setting attributes on {getattr(target, '__qualname__', target)!r}")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _load_build


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
