"""HF ``save_pretrained`` directories: read safetensors (single or sharded with an index) by
slices; write sharded safetensors + ``model.safetensors.index.json`` one tensor at a time.

safetensors' Python API serializes a whole dict at once; a shard is written here as its header
(dtype, shape, byte offsets of every tensor, known up front from the source) followed by each
tensor's bytes as the stream delivers it, so memory holds one tensor, not a shard. The result is
read back by safetensors' own ``safe_open`` in the tests.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import torch

from toolkit.convert.canonical import Source, TensorInfo
from toolkit.convert.errors import ConvertError

INDEX = "model.safetensors.index.json"
CARRY = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
         "merges.txt", "generation_config.json", "added_tokens.json", "chat_template.jinja")
"""Files an HF output carries over from the source (or from the directory of ``--hf-config``)."""

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}


def is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file() and (
        (path / INDEX).is_file() or any(path.glob("*.safetensors")))


class HFSource(Source):
    """Tensors of an HF directory, read lazily through safetensors handles (no optimizer state)."""

    def __init__(self, path: Path, hf_config: dict | None = None):
        config = hf_config or json.loads((path / "config.json").read_text())
        super().__init__(path=path, format="hf", hf_config=config)
        from safetensors import safe_open
        self._where = {}
        for file in self._files(path):
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
        if not files:
            raise ConvertError(f"{path}: no *.safetensors files (only safetensors are read: pickled "
                               "pytorch_model.bin can run code; re-save with safe_serialization=True)")
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


def _dtype(name: str) -> torch.dtype:
    back = {v: k for k, v in _ST_DTYPES.items()}
    if name not in back:
        raise ConvertError(f"safetensors dtype {name} is not supported by the converter")
    return back[name]


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

def plan_shards(infos: dict[str, TensorInfo], dtype: torch.dtype | None, max_bytes: int) -> list[list[str]]:
    """Names per shard in stream order, each shard at most ``max_bytes`` (or one larger tensor)."""
    shards, size = [[]], 0
    for name, info in infos.items():
        n = info.nbytes // info.dtype.itemsize * (dtype or info.dtype).itemsize
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def write_hf(source: Source, out: Path, dtype: torch.dtype | None = None, max_shard_bytes: int = 5 << 30,
             progress=None) -> None:
    """``out/model[-i-of-n].safetensors`` (+ index when sharded), config.json and carried files."""
    shards = plan_shards(source.infos, dtype, max_shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map = {}
    for file, shard in zip(names, shards):
        _write_shard(source, out / file, shard, dtype, progress)
        weight_map.update({n: file for n in shard})
    if len(shards) > 1:
        total = sum(source.infos[n].nbytes // source.infos[n].dtype.itemsize * (dtype or source.infos[n].dtype).itemsize
                    for n in weight_map)
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config = dict(source.hf_config)
    if dtype is not None:
        config["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    for f in source.carry_files:
        shutil.copy2(f, out / f.name)


def _write_shard(source: Source, path: Path, names: list[str], dtype, progress) -> None:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for n in names:
        info = source.infos[n]
        d = dtype or info.dtype
        size = info.nbytes // info.dtype.itemsize * d.itemsize
        header[n] = {"dtype": _ST_DTYPES[d], "shape": list(info.shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors aligns the data start to 8 bytes
    with open(path, "wb", buffering=0) as f:  # unbuffered: kernel copies and writes share the offset
        f.write(struct.pack("<Q", len(blob)) + blob)
        for n in names:
            nbytes = 0
            for piece in _pieces(source, n):
                piece = piece.to(dtype or source.infos[n].dtype).contiguous()
                _write_piece(f, piece, getattr(source, "maps", None))
                nbytes += piece.nbytes
            if progress:
                progress(n, nbytes)


def _write_piece(f, piece: torch.Tensor, maps) -> None:
    """A tensor's bytes appended to ``f``: copied file to file inside the kernel when the tensor is
    a view into a memory-mapped checkpoint (``os.copy_file_range``, the bytes never enter this
    process), else written from memory."""
    where = maps.location(piece) if maps is not None and hasattr(os, "copy_file_range") else None
    if where is not None:
        done = 0
        try:
            with open(where[0], "rb", buffering=0) as src:
                while done < piece.nbytes:
                    n = os.copy_file_range(src.fileno(), f.fileno(), piece.nbytes - done, where[1] + done)
                    if n == 0:
                        raise OSError("short copy")
                    done += n
            return
        except OSError:  # another filesystem on an old kernel, or a short file: write from memory
            f.seek(-done, os.SEEK_CUR)
    data = memoryview(piece.reshape(-1).view(torch.uint8).numpy())
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
