"""Which format a path holds, and its reader. A toolkit run directory means its newest complete
checkpoint; a toolkit checkpoint directory means its ``engine/``."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.formats.canonical import Source
from toolkit.formats.errors import ConvertError
from toolkit.formats.staging import check_manifest
from toolkit.formats.table import FORMATS, SOURCES_HELP, by_name


@dataclass(frozen=True)
class Located:
    """A checkpoint found on disk before any tensor of it is read (torch-free, so the direct
    ZeRO -> HF route can decide without importing a reader): its format, the folder its reader
    opens, the HF config, and a toolkit checkpoint's trainer state."""
    format: str
    """The name of its ``table.Format`` (``table.FORMATS``)"""
    path: Path
    hf_config: dict
    extras: dict = field(default_factory=dict)


def open_source(path, hf_config: str | None = None) -> Source:
    return open_located(locate(path, hf_config))


def locate(path, hf_config: str | None = None) -> Located:
    """Which format ``path`` holds (the first of ``table.FORMATS`` that detects it), where, and its
    config (a damaged manifest is refused here). LoRA adapters come first, found as they lie (their
    config is their base's, which ``toolkit/lora`` finds: ``hf_config`` here is ``--hf-config`` or {})."""
    path = Path(path)
    if not path.exists():
        raise ConvertError(f"{path}: no such file or directory")
    path = resolve_run_dir(path)
    config = _explicit_config(hf_config)
    for fmt in (f for f in FORMATS if f.adapters):
        folder = fmt.detect(path)
        if folder is not None:
            return Located(fmt.name, folder, config or {})
    check_manifest(path)
    for fmt in (f for f in FORMATS if not f.adapters):
        folder = fmt.detect(path)
        if folder is not None:  # a toolkit backend's checkpoint may have its trainer.json beside it
            return Located(fmt.name, folder, config or _config_near(folder),
                           _toolkit_extras(folder) if fmt.backend else {})
    raise ConvertError(f"{path}: unknown checkpoint format; expected {SOURCES_HELP}")


def open_located(found: Located) -> Source:
    """The reader of a located checkpoint (these import torch)."""
    return by_name(found.format).open(found.path, found.hf_config, found.extras)


def resolve_run_dir(path: Path) -> Path:
    if (path / "checkpoints").is_dir() and not (path / "engine").exists():
        from toolkit.storage import newest_complete
        found = newest_complete(path / "checkpoints", log=lambda m: None)
        if found is None:
            raise ConvertError(f"{path}: a run directory without a complete checkpoint")
        return found
    return path


def _explicit_config(hf_config: str | None) -> dict | None:
    if hf_config is None:
        return None
    p = Path(hf_config)
    p = p / "config.json" if p.is_dir() else p
    if not p.is_file():
        raise ConvertError(f"--hf-config {hf_config}: no config.json there")
    return json.loads(p.read_text())


def _config_near(path: Path) -> dict:
    """config.json beside the checkpoint: in it, or up to two levels above (engine/, step dir,
    an HF Trainer ``checkpoint-N/`` holding ``global_stepN/``)."""
    for cand in (path, path.parent, path.parent.parent):
        if (cand / "config.json").is_file():
            return json.loads((cand / "config.json").read_text())
    raise ConvertError(f"{path}: no config.json beside the checkpoint, so the model architecture is unknown; "
                       "pass --hf-config PATH (the model's config.json or its directory)")


def _toolkit_extras(path: Path) -> dict:
    """trainer.json of a toolkit checkpoint (step, samples, seed) when SRC is one."""
    for cand in (path.parent, path.parent.parent):
        if (cand / "trainer.json").is_file():
            return {"trainer_state": json.loads((cand / "trainer.json").read_text())}
    return {}
