"""``toolkit inspect`` of LoRA adapters, read without torch: an HF-PEFT directory
(``adapter_config.json`` + ``adapter_model.safetensors``, as a LoRA run's ``adapter/``) or a toolkit
LoRA checkpoint (adapters only; ``meta.json`` holds the resolved ``lora`` spec and its base).
Converting them is ``lora/convert.py``'s (it needs torch and peft)."""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def is_peft_dir(path: Path) -> bool:
    return (Path(path) / PEFT_CONFIG).is_file()


def lora_checkpoint_meta(path: Path) -> tuple[Path, dict] | None:
    """(checkpoint directory, its meta.json) when ``path`` is in a toolkit LoRA checkpoint."""
    for cand in (path, path.parent, path.parent.parent):
        meta = cand / "meta.json"
        if meta.is_file():
            data = json.loads(meta.read_text())
            if isinstance(data, dict) and "lora" in data:
                return cand, data
    return None


def inspect_peft(path: Path) -> dict:
    """Rank, alpha, targets and the trained parameters of an HF-PEFT adapter directory."""
    path = Path(path)
    config = json.loads((path / PEFT_CONFIG).read_text())
    tensors = _safetensors_shapes(path / PEFT_WEIGHTS) if (path / PEFT_WEIGHTS).is_file() else {}
    return {"path": str(path), "format": "peft", "peft_type": config.get("peft_type"), "rank": config.get("r"),
            "alpha": config.get("lora_alpha"), "targets": config.get("target_modules"),
            "modules_to_save": config.get("modules_to_save"), "base_model": config.get("base_model_name_or_path"),
            "trainable_params": sum(math.prod(shape) for shape, _ in tensors.values()), "tensors": len(tensors),
            "dtypes": sorted({dtype for _, dtype in tensors.values()}), "bytes_on_disk": _size(path)}


def inspect_lora_checkpoint(ckpt: Path, meta: dict) -> dict:
    """A toolkit LoRA checkpoint: its step and layout, the adapters' spec, the base it needs."""
    from toolkit.storage import COMPLETE, MANIFEST
    lora, base = meta["lora"], meta.get("base_model", {})
    return {"path": str(ckpt), "format": f"{meta['format']} (LoRA adapters only)", "family": meta.get("family"),
            "layout": meta.get("layout"), "step": meta.get("step"), "rank": lora["rank"], "alpha": lora["alpha"],
            "targets": lora["targets"], "modules_to_save": lora["modules_to_save"],
            "trainable_params": lora["trainable"], "base_model": base.get("path"),
            "base_fingerprint": base.get("fingerprint"), "bytes_on_disk": _size(ckpt),
            "complete": (ckpt / COMPLETE).is_file() and (ckpt / MANIFEST).is_file()}


def _safetensors_shapes(path: Path) -> dict[str, tuple[list[int], str]]:
    """name -> (shape, dtype) from a safetensors header (8-byte little-endian length, then JSON)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {n: (v["shape"], v["dtype"]) for n, v in header.items() if n != "__metadata__"}


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


PEFT_DCP_MARKER = b".lora_A."
"""In a DCP's ``.metadata`` (read as bytes, never unpickled): a peft LoRA model's adapter names."""


def find_peft_dcp(path: Path) -> Path | None:
    """The DCP directory (a plain one, or accelerate's ``pytorch_model_fsdp_0/``) of a peft model
    (torch-free); a toolkit LoRA checkpoint (megatron's torch_dist keys its adapters by peft name too,
    ``meta.json`` up to two levels above) is not one."""
    import mmap

    from toolkit.formats.describe import ACCELERATE_MODEL, find_dcp_dir
    path = Path(path)
    if lora_checkpoint_meta(path) is not None or (path / "metadata.json").is_file():
        return None
    for folder in (path, path / ACCELERATE_MODEL):
        if find_dcp_dir(folder) is not None and (folder / ".metadata").stat().st_size:
            with open(folder / ".metadata", "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                if m.find(PEFT_DCP_MARKER) >= 0 and m.find(b"base_model.model.") >= 0:  # lora.peft.PEFT_PREFIX
                    return folder
    return None
