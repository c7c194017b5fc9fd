"""HF-PEFT adapter directories (``PeftModel.save_pretrained``; a LoRA run's ``adapter/``):
``adapter_config.json`` + ``adapter_model.safetensors``; and a PyTorch DCP of a peft LoRA model
(FSDP2, or accelerate's ``pytorch_model_fsdp_0/``). Detection here, torch-free; reading, merging and
describing them is ``toolkit/lora/``'s (``convert.py``, ``dcp.py``, ``files.py``)."""
from __future__ import annotations

from pathlib import Path

from toolkit.formats.describe import ACCELERATE_MODEL, describe_dcp, find_dcp_dir
from toolkit.formats.errors import ConvertError
from toolkit.formats.lora_checkpoint import lora_checkpoint_meta

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_DCP_MARKER = b".lora_A."
"""In a DCP's ``.metadata`` (read as bytes, never unpickled): a peft LoRA model's adapter names."""


def find_peft_dir(path: Path) -> Path | None:
    return path if (Path(path) / PEFT_CONFIG).is_file() else None


def find_peft_checkpoint(path: Path) -> Path | None:
    """``path`` when it holds a DCP of a peft model, itself or as accelerate's ``checkpoint-N/`` (the
    table's detector: the LoRA reader finds the model and optimizer directories in it)."""
    return path if find_peft_dcp(path) is not None else None


def find_peft_dcp(path: Path) -> Path | None:
    """The DCP directory (a plain one, or accelerate's ``pytorch_model_fsdp_0/``) of a peft model; a
    toolkit LoRA checkpoint (megatron's torch_dist keys its adapters by peft name too, ``meta.json`` up
    to two levels above) is not one."""
    import mmap
    path = Path(path)
    if lora_checkpoint_meta(path) is not None or (path / "metadata.json").is_file():
        return None
    for folder in (path, path / ACCELERATE_MODEL):
        if find_dcp_dir(folder) is not None and (folder / ".metadata").stat().st_size:
            with open(folder / ".metadata", "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                if m.find(PEFT_DCP_MARKER) >= 0 and m.find(b"base_model.model.") >= 0:  # lora.peft.PEFT_PREFIX
                    return folder
    return None


def peft_whole_only(folder: Path, hf_config: dict, **extras):
    """The table's reader: an adapter directory holds no model to stream."""
    raise ConvertError(f"{folder}: an HF-PEFT adapter directory (LoRA); it converts only as a whole: toolkit "
                       "convert DIR OUT --to hf [--base BASE_DIR] (merged onto its base) or --to peft")


def peft_dcp_whole_only(folder: Path, hf_config: dict, **extras):
    raise ConvertError(f"{folder}: a DCP of a peft LoRA model; it converts only as a whole: toolkit convert DIR OUT "
                       "--to peft (the adapter) or --to hf (merged onto the DCP's own base weights)")


def describe_peft(path: Path) -> dict:
    """An adapter directory holds whole tensors: no parallel layout."""
    return {}


def describe_peft_dcp(path: Path) -> dict:
    """The number of ranks that wrote its model directory."""
    return describe_dcp(find_peft_dcp(path))
