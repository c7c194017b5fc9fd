"""ZeRO -> HF safetensors without torch: each parameter's fp32 bytes copied file to file by the kernel.

Why: a native ZeRO checkpoint already holds every parameter's fp32 bytes; an HF directory is those
bytes behind a JSON header. On the 134M-parameter benchmark (benchmarks/convert.py) ``import torch``
alone took 1.48 s of the 2.6 s DeepSpeed's ``zero_to_fp32`` needs, so no reader that imports torch
can convert in half its time. This route imports neither torch nor transformers, DeepSpeed or numpy:
  ``torchzip.load``     the ``.pt`` archives' pickles, tensors as records of where their bytes lie
  ``ZeroIndex``         the same layout index ``ZeroSource`` uses (names, order, fragments, padding)
  ``hf.write_hf_files`` the same shard plan, headers, index and config.json as the torch writer
  ``hf.copy_range``     ``os.copy_file_range`` of each fragment's byte range
so the output is byte for byte the torch path's, staged and given a manifest the same way.

It applies to ``--to hf`` without ``--dtype`` from a native (not universal) ZeRO 1/2/3 checkpoint
whose config.json says whether embeddings are tied, packs no experts, and whose tensors are fp32,
contiguous, uncompressed. Anything else, or anything the pickles hold that ``torchzip`` does not
take (a foreign class among them), makes ``open_direct`` return None and ``run.convert`` uses the
torch reader, which reads it or refuses it with its own message.
"""
from __future__ import annotations

import math
from pathlib import Path

from toolkit.formats import torchzip
from toolkit.formats.errors import ConvertError
from toolkit.formats.hf import Slot, copy_range, write_hf_files
from toolkit.formats.zero_index import ZeroIndex, spans


class NotDirect(Exception):
    """Why the direct route does not apply (the torch reader is used instead)."""


def open_direct(found) -> ZeroBytes | None:
    """The direct reader of a located checkpoint (``detect.Located``), or None where the torch
    reader must do the work. Every check runs here, before DST exists: once writing starts the
    route cannot fall back."""
    if found.format != "zero":
        return None
    try:
        return ZeroBytes(found)
    except ConvertError:
        raise  # the index's own findings (a rank file missing): the torch reader would say the same
    except Exception:  # NotDirect, torchzip.Unsupported, a damaged archive: the torch reader reads it
        return None    # or explains what is wrong with it, in its own words


class ZeroBytes:
    """A native ZeRO checkpoint as byte ranges: every HF tensor's fp32 elements, as ``(file,
    offset, bytes)`` runs in the optimizer partitions (or frozen parameters' model-states tensors)."""

    format = "zero"
    has_optimizer = True

    def __init__(self, found):
        _check_no_packed_experts(found.hf_config)
        self.path, self.hf_config = found.path, found.hf_config
        self.carry_files: list[Path] = []  # as ZeroSource: nothing beside a ZeRO checkpoint is carried
        self.index = ZeroIndex(found.path, torchzip.load, _tied(found.hf_config))
        self.step = self.index.step
        self.infos = {name: Slot("F32", shape, math.prod(shape) * 4) for name, shape in self.index.shapes.items()}
        """HF name -> ``hf.Slot`` (what the writer and the progress bar read)."""
        self.ranges = {name: _byte_ranges(self.index, name, slot.nbytes) for name, slot in self.infos.items()}

    @property
    def model_type(self) -> str | None:
        return self.hf_config.get("model_type")

    def write_hf(self, out: Path, max_shard_bytes: int, progress=None) -> None:
        write_hf_files(out, self.infos, self._copy, dict(self.hf_config), self.carry_files, max_shard_bytes, progress)

    def _copy(self, f, name: str) -> int:
        for path, offset, nbytes in self.ranges[name]:
            copy_range(f, path, offset, nbytes)
        return self.infos[name].nbytes

    def close(self) -> None:
        pass


def _check_no_packed_experts(config: dict) -> None:
    """transformers >= 5 packs a layer's experts in one module parameter; the family table that
    unpacks them into checkpoint tensors (``zero.module_layout``) needs torch. Only mixture-of-experts
    families pack (tests/distributed/test_convert_torchfree.py checks every family), and their configs name
    their experts."""
    if any("expert" in key and value for key, value in config.items()):
        raise NotDirect("a mixture-of-experts config: packed experts are unpacked by the family table")


def _tied(config: dict) -> bool:
    """``Source.tied`` without transformers: only a config.json that says it."""
    if "tie_word_embeddings" not in config:
        raise NotDirect("config.json does not say tie_word_embeddings (its class default needs transformers)")
    return bool(config["tie_word_embeddings"])


def _byte_ranges(index: ZeroIndex, name: str, nbytes: int) -> list[tuple[str, int, int]]:
    """Where tensor ``name``'s ``nbytes`` fp32 bytes lie, in order, padding left out."""
    out = []
    for frag, first, count in spans(index.frags[name], 0, math.prod(index.shapes[name])):
        holder = index.holder(frag)
        if not isinstance(holder, torchzip.Tensor) or holder.dtype != "float32":
            raise NotDirect(f"{name}: stored as {getattr(holder, 'dtype', type(holder).__name__)}, not fp32")
        out.append(holder.byte_range(first, count))
    if sum(n for _, _, n in out) != nbytes:  # fragments short of the shape: the torch path names it
        raise NotDirect(f"{name}: fragments hold {sum(n for _, _, n in out)} of {nbytes} bytes")
    return out
