"""HF ``save_pretrained`` directories: read safetensors (single or sharded with an index) by
slices; write sharded safetensors + ``model.safetensors.index.json`` one tensor at a time.

safetensors' Python API serializes a whole dict at once; a shard is written here as its header
(dtype, shape, byte offsets of every tensor, known up front from the source) followed by each
tensor's bytes as the stream delivers it, so memory holds one tensor, not a shard. The result is
read back by safetensors' own ``safe_open`` in the tests. ``write_hf_files`` (plan, headers, index,
config) imports no torch: the direct ZeRO -> HF route (``direct.py``) writes through it too, so
both routes produce the same bytes.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from toolkit.formats.canonical import Source, TensorInfo, WriteRequest
from toolkit.formats.errors import ConvertError

if TYPE_CHECKING:  # annotations only: the writer runs without torch on the direct route
    import torch

INDEX = "model.safetensors.index.json"
PICKLED_INDEX = "pytorch_model.bin.index.json"
CARRY = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
         "merges.txt", "generation_config.json", "added_tokens.json", "chat_template.jinja")
"""Files an HF output carries over from the source (or from the directory of ``--hf-config``)."""

ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "int64": "I64",
             "int32": "I32", "uint8": "U8", "bool": "BOOL"}
"""torch dtype name -> safetensors dtype. By name, so that the writer needs no torch import (the
direct ZeRO -> HF route in ``direct.py`` writes through it without torch)."""


def is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file() and (
        (path / INDEX).is_file() or any(path.glob("*.safetensors")) or (path / PICKLED_INDEX).is_file()
        or any(path.glob("pytorch_model*.bin")))


class HFSource(Source):
    """Tensors of an HF directory, read lazily through safetensors handles (no optimizer state)."""

    def __init__(self, path: Path, hf_config: dict | None = None):
        config = hf_config or json.loads((path / "config.json").read_text())
        super().__init__(path=path, format="hf", hf_config=config)
        from safetensors import safe_open  # framework="pt" imports torch: an HF source is read with it
        self._where = {}
        for file in self._files(path):
            if file.suffix == ".bin":
                handle = PickledShard(file)
            else:
                try:
                    handle = safe_open(str(file), framework="pt")
                except Exception as exc:  # safetensors raises its own error types for damaged headers
                    raise ConvertError(f"{file}: not a readable safetensors file ({exc}); it is truncated or "
                                       "corrupted") from None
                _check_size(file, handle)
            for key in handle.keys():
                self._where[key] = handle
        for key, handle in self._where.items():
            sl = handle.get_slice(key)
            self.infos[key] = TensorInfo(tuple(sl.get_shape()), _dtype(sl.get_dtype()))
        if self.tied:
            self._tie()
        self.carry_files = [path / n for n in CARRY if (path / n).is_file()]
        self.layout = {}

    def _files(self, path: Path) -> list[Path]:
        index = path / INDEX
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            missing = [f for f in files if not (path / f).is_file()]
            if missing:
                raise ConvertError(f"{path}: shard(s) {missing} named in {INDEX} are missing; copy them or "
                                   "re-export the model")
            return [path / f for f in files]
        files = sorted(path.glob("*.safetensors"))
        if files:
            return files
        pickled_index = path / PICKLED_INDEX
        files = sorted({path / f for f in json.loads(pickled_index.read_text())["weight_map"].values()}) \
            if pickled_index.is_file() else sorted(path.glob("pytorch_model*.bin"))
        missing = [f.name for f in files if not f.is_file()]
        if missing or not files:
            raise ConvertError(f"{path}: no *.safetensors files and no complete pytorch_model*.bin set (missing: "
                               f"{missing or 'every file'}); copy the model's weight files")
        return files

    def _tie(self) -> None:
        """A tied model's canonical names have no lm_head; some exports keep only lm_head."""
        emb = next((k for k in self.infos if k.endswith("embed_tokens.weight") or k.endswith("wte.weight")), None)
        if emb is None and "lm_head.weight" in self.infos:
            raise ConvertError(f"{self.path}: tied embeddings but only lm_head.weight is stored; re-save the model "
                               "with save_pretrained")
        self.infos.pop("lm_head.weight", None)

    def read(self, name: str, state: str = "param") -> torch.Tensor:
        if state != "param":
            raise ConvertError(f"{self.path}: an HF directory holds no optimizer state ({state})")
        return self._where[name].get_tensor(name)

    def slice_of(self, name: str):
        """safetensors' lazy slice of ``name`` (index it to read only that part)."""
        return self._where[name].get_slice(name)


class PickledShard:
    """A ``pytorch_model*.bin`` shard behind safetensors' handle API (``keys``, ``get_slice``,
    ``get_tensor``), read through the converter's allowlisted unpickler (``safeload.py``: tensors
    and containers only, never code), memory-mapped: a tensor's pages are read when it is touched."""

    def __init__(self, file: Path):
        from toolkit.formats.safeload import safe_load
        state = safe_load(file)
        if not isinstance(state, dict):
            raise ConvertError(f"{file}: holds a {type(state).__name__}, not a state dict of tensors")
        self.tensors = {k: v for k, v in state.items() if hasattr(v, "shape")}

    def keys(self):
        return self.tensors.keys()

    def get_tensor(self, key: str) -> "torch.Tensor":
        return self.tensors[key].clone()  # a copy, as safetensors returns: callers may keep it

    def get_slice(self, key: str) -> "_PickledSlice":
        return _PickledSlice(self.tensors[key])


class _PickledSlice:
    def __init__(self, tensor):
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def get_dtype(self) -> str:
        return ST_DTYPES[_dtype_name(self.tensor.dtype)]

    def __getitem__(self, index) -> "torch.Tensor":
        return self.tensor[index].clone()


def _dtype(name: str) -> torch.dtype:
    import torch
    back = {v: k for k, v in ST_DTYPES.items()}
    if name not in back:
        raise ConvertError(f"safetensors dtype {name} is not supported by the converter")
    return getattr(torch, back[name])


def _check_size(file: Path, handle) -> None:
    """A truncated shard still has a readable header; its data end must lie inside the file."""
    with open(file, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    have = file.stat().st_size - 8 - header_len
    if have < end:
        raise ConvertError(f"{file}: {have} bytes of tensor data, the header says {end}; the file is truncated "
                           "(copy it again)")


# --- writer ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Slot:
    """One tensor of the output as its shard header lists it: safetensors dtype, shape, bytes."""
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


TensorWriter = Callable[[object, str], int]
"""``write(f, name)``: append tensor ``name``'s bytes to the unbuffered file ``f``; returns bytes."""


def plan_shards(slots: dict[str, Slot], max_bytes: int) -> list[list[str]]:
    """Names per shard in stream order, each shard at most ``max_bytes`` (or one larger tensor)."""
    shards, size = [[]], 0
    for name, slot in slots.items():
        if shards[-1] and size + slot.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += slot.nbytes
    return shards


def write_hf(source: Source, out: Path, dtype: torch.dtype | None = None, max_shard_bytes: int = 5 << 30,
             progress=None) -> None:
    """``out/model[-i-of-n].safetensors`` (+ index when sharded), config.json and carried files."""
    slots = {n: _slot(info, dtype) for n, info in source.infos.items()}
    config = dict(source.hf_config)
    if dtype is not None:
        config["dtype"] = _dtype_name(dtype)
    write_hf_files(out, slots, _tensor_writer(source, dtype), config, source.carry_files, max_shard_bytes, progress)


def write(source: Source, out: Path, request: WriteRequest, progress=None) -> dict:
    """The table's writer (``table.Format.write``); an HF directory has no parallel layout: {}."""
    write_hf(source, out, request.dtype, request.max_shard_bytes, progress)
    return {}


def write_hf_files(out: Path, slots: dict[str, Slot], write: TensorWriter, config: dict, carry_files: list[Path],
                   max_shard_bytes: int, progress=None) -> None:
    """The files of an HF directory, the tensors' bytes appended by ``write`` in ``slots`` order."""
    shards = plan_shards(slots, max_shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map = {}
    for file, shard in zip(names, shards):
        _write_shard(out / file, {n: slots[n] for n in shard}, write, progress)
        weight_map.update({n: file for n in shard})
    if len(shards) > 1:
        total = sum(slot.nbytes for slot in slots.values())
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    for f in carry_files:
        shutil.copy2(f, out / f.name)


def _write_shard(path: Path, slots: dict[str, Slot], write: TensorWriter, progress) -> None:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for n, slot in slots.items():
        header[n] = {"dtype": slot.dtype, "shape": list(slot.shape), "data_offsets": [offset, offset + slot.nbytes]}
        offset += slot.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors aligns the data start to 8 bytes
    with open(path, "wb", buffering=0) as f:  # unbuffered: kernel copies and writes share the offset
        f.write(struct.pack("<Q", len(blob)) + blob)
        for n, slot in slots.items():
            nbytes = write(f, n)
            if nbytes != slot.nbytes:
                raise ConvertError(f"{n}: {nbytes} bytes written, the header says {slot.nbytes}")
            if progress:
                progress(n, nbytes)


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _slot(info: TensorInfo, dtype) -> Slot:
    d = dtype or info.dtype
    return Slot(ST_DTYPES[_dtype_name(d)], tuple(info.shape), info.nbytes // info.dtype.itemsize * d.itemsize)


def _tensor_writer(source: Source, dtype) -> TensorWriter:
    """Writes a source's tensor piece by piece (cast to ``dtype`` when given)."""
    maps = getattr(source, "maps", None)

    def write(f, name: str) -> int:
        nbytes = 0
        for piece in _pieces(source, name):
            piece = piece.to(dtype or source.infos[name].dtype).contiguous()
            _write_piece(f, piece, maps)
            nbytes += piece.nbytes
        return nbytes
    return write


def _write_piece(f, piece: torch.Tensor, maps) -> None:
    """A tensor's bytes appended to ``f``: copied file to file when the tensor is a view into a
    memory-mapped checkpoint, else written from memory."""
    where = maps.location(piece) if maps is not None else None
    if where is not None:
        copy_range(f, where[0], where[1], piece.nbytes)
        return
    import torch
    _write_all(f, memoryview(piece.reshape(-1).view(torch.uint8).numpy()))


def copy_range(f, path: str, offset: int, nbytes: int) -> None:
    """Bytes ``[offset, offset + nbytes)`` of file ``path`` appended to the unbuffered file ``f``:
    inside the kernel (``os.copy_file_range``, the bytes never enter this process) where it can,
    else read and written in blocks (another filesystem on an old kernel)."""
    done = 0
    with open(path, "rb", buffering=0) as src:
        if hasattr(os, "copy_file_range"):
            try:
                while done < nbytes:
                    n = os.copy_file_range(src.fileno(), f.fileno(), nbytes - done, offset + done)
                    if n == 0:
                        break  # the file ends early: the read below says so
                    done += n
            except OSError:
                pass
        while done < nbytes:
            block = os.pread(src.fileno(), min(nbytes - done, 16 << 20), offset + done)
            if not block:
                raise ConvertError(f"{path}: ends before byte {offset + nbytes}; the file is truncated")
            _write_all(f, memoryview(block))
            done += len(block)


def _write_all(f, data: memoryview) -> None:
    while data:
        data = data[f.write(data):]


def _pieces(source: Source, name: str):
    """The tensor's bytes in order: straight from a source's memory-mapped pieces when it has them
    (no full copy; pages given back after each), else the whole tensor."""
    if not hasattr(source, "pieces"):
        yield source.read(name)
        return
    for piece in source.pieces(name):
        yield piece
        source.maps.release(piece)
