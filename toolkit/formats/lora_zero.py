"""A DeepSpeed LoRA run's checkpoint: the adapters (and their Adam moments) as DeepSpeed saves a
ZeRO checkpoint under ``engine/``, ``meta.json`` in the toolkit's ``toolkit-deepspeed`` format with
its ``lora`` spec (``lora_checkpoint.py``; read and written by ``toolkit/lora/checkpoint.py``)."""
from __future__ import annotations

from pathlib import Path

from toolkit.formats.lora_checkpoint import find_lora_checkpoint


def find_zero_lora(path: Path) -> Path | None:
    return find_lora_checkpoint(path, "deepspeed")
