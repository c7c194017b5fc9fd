"""A megatron LoRA run's checkpoint: the adapters (HF-PEFT names; packed projections' B in the
engine's row blocks) and their moments in a torch_dist directory under ``engine/``, ``meta.json`` in
the toolkit's ``toolkit-megatron`` format with its ``lora`` spec (``lora_checkpoint.py``; read and
written by ``toolkit/lora/checkpoint.py``)."""
from __future__ import annotations

from pathlib import Path

from toolkit.formats.lora_checkpoint import find_lora_checkpoint


def find_megatron_lora(path: Path) -> Path | None:
    return find_lora_checkpoint(path, "megatron")
