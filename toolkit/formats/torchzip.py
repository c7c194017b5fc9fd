"""``torch.save`` archives read without torch: tensors become records of where their bytes lie.

Why: converting a ZeRO checkpoint to HF safetensors only moves fp32 bytes from one file to another;
``import torch`` alone costs ~1.5 s of the ~2.6 s DeepSpeed's ``zero_to_fp32`` takes for a 134M
model, so the direct ZeRO -> HF route (``direct.py``) reads the archives with this module instead.

A ``torch.save`` file is a zip of ``ARCHIVE/data.pkl`` (the object, pickle protocol 2) and one
entry ``ARCHIVE/data/KEY`` per storage, stored uncompressed. ``load`` unpickles ``data.pkl`` with
``pickle.Unpickler``, whose ``find_class`` answers only the names listed in ``_GLOBALS`` plus
``safeload.STAND_INS`` (data-only stand-ins, never the real classes) and whose ``persistent_load``
turns a storage reference into a ``Storage`` record: the absolute byte offset of that entry's data
in the file (local zip header + 30 + name length + extra length). Only the listed stand-ins are called, no tensor
byte is read. Whatever this reader does not take (another class, a compressed entry, a big-endian
file, tensor metadata) raises ``Unsupported``: the caller then uses the torch reader, which either
reads it or refuses it with ``safeload``'s message.
"""
from __future__ import annotations

import collections
import io
import math
import os
import pickle
import struct
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path

from toolkit.formats.safeload import STAND_INS


class Unsupported(Exception):
    """Something this reader does not take; the torch reader handles (or refuses) it."""


@dataclass(frozen=True)
class _StorageType:
    """Stand-in for ``torch.FloatStorage`` and its kin: the element type a storage holds."""
    dtype: str
    itemsize: int


_STORAGE_TYPES = {"FloatStorage": ("float32", 4), "DoubleStorage": ("float64", 8), "HalfStorage": ("float16", 2),
                  "BFloat16Storage": ("bfloat16", 2), "LongStorage": ("int64", 8), "IntStorage": ("int32", 4),
                  "ShortStorage": ("int16", 2), "CharStorage": ("int8", 1), "ByteStorage": ("uint8", 1),
                  "BoolStorage": ("bool", 1)}
_SCALAR_FORMATS = {"float32": "<f", "float64": "<d", "float16": "<e", "int64": "<q", "int32": "<i", "int16": "<h",
                   "int8": "<b", "uint8": "<B", "bool": "<?"}
"""struct formats to read a one-element tensor (an optimizer step); bfloat16 has none."""


@dataclass(frozen=True)
class Storage:
    """A storage's bytes: ``numel`` elements of ``dtype`` from byte ``offset`` of file ``path``."""
    path: str
    offset: int
    dtype: str
    itemsize: int
    numel: int


@dataclass(frozen=True)
class Tensor:
    """What ``torch._utils._rebuild_tensor_v2`` would have built, as a description: a strided view
    of ``storage`` starting ``storage_offset`` elements in."""
    storage: Storage
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dtype(self) -> str:
        return self.storage.dtype

    def numel(self) -> int:
        return math.prod(self.shape)

    def is_contiguous(self) -> bool:
        """Row-major without gaps (the strides of size-1 dimensions do not matter), as torch says."""
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def byte_range(self, start: int, count: int) -> tuple[str, int, int]:
        """(file, byte offset, byte count) of elements ``[start, start + count)`` of the flattened
        tensor; only a contiguous tensor has one."""
        if not self.is_contiguous():
            raise Unsupported(f"a non-contiguous tensor (shape {self.shape}, stride {self.stride})")
        if start < 0 or count < 0 or start + count > self.numel():
            raise Unsupported(f"elements [{start}, {start + count}) of a tensor of {self.numel()}")
        first = self.storage_offset + start
        if self.storage_offset < 0 or first + count > self.storage.numel:
            raise Unsupported("a tensor reaching outside its storage")
        size = self.storage.itemsize
        return self.storage.path, self.storage.offset + first * size, count * size

    def item(self):
        """The value of a one-element tensor, read from the file."""
        fmt = _SCALAR_FORMATS.get(self.dtype)
        if self.numel() != 1 or fmt is None:
            raise Unsupported(f"item() of a {self.dtype} tensor of {self.numel()} elements")
        path, offset, nbytes = self.byte_range(0, 1)
        with open(path, "rb") as f:
            f.seek(offset)
            return struct.unpack(fmt, f.read(nbytes))[0]


_TENSOR_TYPE = object()
"""Stand-in for ``torch.Tensor`` where a pickle names the class (``_rebuild_from_type_v2``)."""


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata=None):
    if not isinstance(storage, Storage) or backward_hooks or metadata:
        raise Unsupported("a tensor with backward hooks or metadata")
    return Tensor(storage, int(storage_offset), tuple(size), tuple(stride))


def _rebuild_parameter(data, requires_grad, backward_hooks):
    if not isinstance(data, Tensor) or backward_hooks:
        raise Unsupported("a parameter with backward hooks")
    return data


def _rebuild_from_type(func, new_type, args, state):
    """A plain tensor saved with Python attributes (DeepSpeed's ``ds_id`` on stage 3 partitions):
    the attributes do not change its bytes and are dropped."""
    if func is not _REBUILD_TENSOR or new_type is not _TENSOR_TYPE:
        raise Unsupported("a tensor subclass")
    return _rebuild_tensor(*args)


class _Sealed:
    """An allowed function as the unpickler hands it out. A pickle's BUILD opcode sets attributes on
    any object without ``__setstate__``: on a plain function it could rewrite its defaults for the
    rest of the process. This wrapper has no attributes to set and refuses a state."""
    __slots__ = ("_fn",)

    def __init__(self, fn):
        object.__setattr__(self, "_fn", fn)

    def __call__(self, *args):
        return self._fn(*args)

    def __setstate__(self, state):
        raise Unsupported(f"a pickle setting state on {self._fn.__name__}")


_REBUILD_TENSOR = _Sealed(_rebuild_tensor)
_GLOBALS = {
    "torch._utils._rebuild_tensor_v2": _REBUILD_TENSOR,
    "torch._utils._rebuild_parameter": _Sealed(_rebuild_parameter),
    "torch._tensor._rebuild_from_type_v2": _Sealed(_rebuild_from_type),
    "torch.Tensor": _TENSOR_TYPE,
    "torch.Size": tuple,
    "collections.OrderedDict": collections.OrderedDict,
    **{f"torch.{name}": _StorageType(*spec) for name, spec in _STORAGE_TYPES.items()},
    **{name: _Sealed(fn) if isinstance(fn, types.FunctionType) else fn for name, fn in STAND_INS.items()},
}
"""Every name a checkpoint pickle may reference, and what it means here (functions sealed; the
classes are immutable types or, like ``safeload.Fields``, take a state by their own ``__setstate__``)."""


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, storage):
        super().__init__(io.BytesIO(data))
        self._storage = storage

    def find_class(self, module: str, name: str):
        try:
            return _GLOBALS[f"{module}.{name}"]
        except KeyError:
            raise Unsupported(f"global {module}.{name}") from None

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType)):
            raise Unsupported(f"persistent id {pid!r}")
        _, kind, key, _location, numel = pid
        return self._storage(str(key), kind, int(numel))


def load(path) -> object:
    """The object ``torch.load(path)`` would return, tensors as ``Tensor`` records."""
    path = str(Path(path).resolve())
    with zipfile.ZipFile(path) as archive:
        prefix = _archive_prefix(archive)
        if f"{prefix}byteorder" in archive.NameToInfo and archive.read(f"{prefix}byteorder") != b"little":
            raise Unsupported("a big-endian archive")
        data = archive.read(f"{prefix}data.pkl")
        with open(path, "rb") as raw:
            storages = _StorageLocator(path, archive, raw, prefix)
            return _Unpickler(data, storages).load()


def _archive_prefix(archive: zipfile.ZipFile) -> str:
    """``ARCHIVE/``: the folder of the one top-level ``data.pkl``."""
    found = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(found) != 1:
        raise Unsupported(f"{len(found)} top-level data.pkl entries")
    return found[0].removesuffix("data.pkl")


class _StorageLocator:
    """``ARCHIVE/data/KEY`` -> ``Storage``: where the entry's bytes begin in the file."""

    def __init__(self, path: str, archive: zipfile.ZipFile, raw, prefix: str):
        self.path, self.archive, self.raw, self.prefix = path, archive, raw, prefix
        self.found: dict[str, Storage] = {}

    def __call__(self, key: str, kind: _StorageType, numel: int) -> Storage:
        if key not in self.found:
            self.found[key] = self._locate(key, kind, numel)
        return self.found[key]

    def _locate(self, key: str, kind: _StorageType, numel: int) -> Storage:
        info = self.archive.getinfo(f"{self.prefix}data/{key}")
        if info.compress_type != zipfile.ZIP_STORED:
            raise Unsupported(f"a compressed storage entry ({info.filename})")
        if info.file_size < numel * kind.itemsize:
            raise Unsupported(f"{info.filename}: {info.file_size} bytes for {numel} x {kind.itemsize}")
        # The local header's extra field (torch pads it to align the data) may differ from the
        # central directory's, so its lengths are read from the local header itself.
        header = os.pread(self.raw.fileno(), 30, info.header_offset)
        if len(header) != 30 or header[:4] != b"PK\x03\x04":
            raise Unsupported(f"{info.filename}: no local file header at {info.header_offset}")
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        return Storage(self.path, info.header_offset + 30 + name_len + extra_len, kind.dtype, kind.itemsize, numel)
