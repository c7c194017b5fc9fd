"""The one description schema of a toolkit checkpoint, written by the trainer's saves and by the
converter (so ``toolkit train --resume auto`` continues from either), read by resume and convert:

  meta.json            format (toolkit-deepspeed | toolkit-megatron), family, step, layout (the
                       ``Layout.record()`` of the run that wrote it), vocab_size, dtype, versions;
                       a converted checkpoint adds ``converted_from``; a LoRA checkpoint (adapters
                       only) adds ``lora`` (the plan's ``LoraSpec``) and ``base_model``
                       (``base_model_record``: the frozen base it needs)
  trainer.json         the loop's progress: step, consumed_samples, consumed_tokens, seed,
                       skipped_steps (fp16), reference (DPO: the key of the reference scores it
                       trained against, ``train/reference.py``)
  config.json          the HF model config
  trainer/rank_XXXXX.pt  per-rank RNG state (``torch.load(weights_only=True)``)
"""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from toolkit import __version__
from toolkit.storage import write_json_durable

META, PROGRESS, HF_CONFIG, RNG_DIR = "meta.json", "trainer.json", "config.json", "trainer"
CHECKPOINT_FORMATS = {"deepspeed": "toolkit-deepspeed", "megatron": "toolkit-megatron"}


def write_descriptions(stage: Path, backend: str, model_type: str, hf_config: dict, layout: dict, dtype: str,
                       progress: dict, **extra) -> None:
    """meta.json, trainer.json and config.json of a checkpoint being built in ``stage``."""
    import torch
    write_json_durable(stage / PROGRESS, progress)
    write_json_durable(stage / META, {
        "format": CHECKPOINT_FORMATS[backend], "family": model_type, "step": progress["step"], "layout": layout,
        "vocab_size": hf_config.get("vocab_size"), "dtype": dtype, "toolkit_version": __version__,
        "torch_version": torch.__version__, **extra})
    write_json_durable(stage / HF_CONFIG, hf_config)


def rng_file(ckpt: Path, rank: int) -> Path:
    return Path(ckpt) / RNG_DIR / f"rank_{rank:05d}.pt"


def read_meta(ckpt: Path) -> dict:
    return json.loads((Path(ckpt) / META).read_text())


def read_progress(ckpt: Path) -> dict:
    return json.loads((Path(ckpt) / PROGRESS).read_text())


def read_hf_config(ckpt: Path) -> dict:
    return json.loads((Path(ckpt) / HF_CONFIG).read_text())


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.index.json", "config.json")
"""What identifies a pretrained base in its directory (tokenizer files may change freely)."""


def base_model_record(name_or_path: str, init: str, seed: int) -> dict:
    """The frozen base a LoRA checkpoint was trained on: its path, and a fingerprint cheap enough to
    take at every save and resume: the weight files' names and sizes and a hash of each safetensors
    header (names, dtypes, shapes, offsets), not of the weights. A randomly initialized base is its
    seed (the config is compared field by field already)."""
    if init == "random":
        return {"path": name_or_path, "init": "random", "fingerprint": f"random-init seed {seed}"}
    root = Path(name_or_path)
    root = root.parent if root.is_file() else root
    digest = hashlib.sha256()
    files = sorted({f for pattern in WEIGHT_FILES for f in root.glob(pattern) if f.is_file()})
    for f in files:
        digest.update(f"{f.name}\0{f.stat().st_size}\0".encode())
        if f.suffix == ".safetensors":
            digest.update(_safetensors_header(f))
    return {"path": str(root), "init": "pretrained", "fingerprint": f"sha256:{digest.hexdigest()[:32]}",
            "files": len(files)}


def _safetensors_header(path: Path) -> bytes:
    """The JSON header of a safetensors file (an 8-byte little-endian length, then the header)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return f.read(min(length, 100 * 2**20))
