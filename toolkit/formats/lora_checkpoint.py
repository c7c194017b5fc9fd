"""What the two toolkit LoRA checkpoint formats (``lora_zero.py``, ``lora_megatron.py``) share: a
toolkit checkpoint whose ``meta.json`` holds the resolved ``lora`` spec and its base holds the
adapters only (and their Adam moments), under ``engine/`` in its backend's own format. Read without
torch; converting and describing them is ``toolkit/lora/``'s (``checkpoint.py``, ``files.py``)."""
from __future__ import annotations

from pathlib import Path

from toolkit.formats.errors import ConvertError
from toolkit.storage.meta import CHECKPOINT_FORMATS, META, read_meta


def lora_checkpoint_meta(path: Path) -> tuple[Path, dict] | None:
    """(checkpoint directory, its meta.json) when ``path`` is in a toolkit LoRA checkpoint (the
    checkpoint, its ``engine/`` or a folder in that)."""
    for cand in (path, path.parent, path.parent.parent):
        if (cand / META).is_file():
            data = read_meta(cand)
            if isinstance(data, dict) and "lora" in data:
                return cand, data
    return None


def find_lora_checkpoint(path: Path, backend: str) -> Path | None:
    """The LoRA checkpoint of ``backend`` that ``path`` lies in (the table's detector)."""
    found = lora_checkpoint_meta(path)
    return found[0] if found is not None and found[1].get("format") == CHECKPOINT_FORMATS[backend] else None


def whole_only(folder: Path, hf_config: dict, **extras):
    """The table's reader: a LoRA checkpoint holds adapters, never a model's tensors to stream."""
    base = read_meta(folder).get("base_model", {}).get("path")
    raise ConvertError(f"{folder}: a LoRA checkpoint (adapters only, base {base}); it converts only as a whole: "
                       "toolkit convert CKPT OUT --to peft (the adapter) or --to hf (merged onto its base)")


def describe_lora_checkpoint(folder: Path) -> dict:
    """The layout it was written at, from its meta.json."""
    return dict(read_meta(folder).get("layout", {}))
