"""``toolkit inspect`` of LoRA adapters, read without torch: an HF-PEFT directory
(``adapter_config.json`` + ``adapter_model.safetensors``, as a LoRA run's ``adapter/``) or a toolkit
LoRA checkpoint (adapters only; ``meta.json`` holds the resolved ``lora`` spec and its base). Their
formats and detection are ``toolkit/formats/`` (``peft.py``, ``lora_zero.py``, ``lora_megatron.py``);
converting them is ``lora/convert.py``'s (it needs torch and peft)."""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from toolkit.formats.peft import PEFT_CONFIG, PEFT_WEIGHTS


def inspect_peft(found, hf_config: str | None = None) -> dict:
    """Rank, alpha, targets and the trained parameters of an HF-PEFT adapter directory (``found``:
    where ``formats.detect.locate`` found it)."""
    path = Path(found.path)
    config = json.loads((path / PEFT_CONFIG).read_text())
    tensors = _safetensors_shapes(path / PEFT_WEIGHTS) if (path / PEFT_WEIGHTS).is_file() else {}
    return {"path": str(path), "format": "peft", "peft_type": config.get("peft_type"), "rank": config.get("r"),
            "alpha": config.get("lora_alpha"), "targets": config.get("target_modules"),
            "modules_to_save": config.get("modules_to_save"), "base_model": config.get("base_model_name_or_path"),
            "trainable_params": sum(math.prod(shape) for shape, _ in tensors.values()), "tensors": len(tensors),
            "dtypes": sorted({dtype for _, dtype in tensors.values()}), "bytes_on_disk": _size(path)}


def inspect_lora_checkpoint(found, hf_config: str | None = None) -> dict:
    """A toolkit LoRA checkpoint: its step and layout, the adapters' spec, the base it needs."""
    from toolkit.storage import COMPLETE, MANIFEST
    from toolkit.storage.meta import read_meta
    ckpt = Path(found.path)
    meta = read_meta(ckpt)
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
