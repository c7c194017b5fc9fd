"""Tiny vision-language models and image-text rows for the VLM tests (``examples/vlm/``'s builders)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vlm"
FAMILIES = ("qwen2_5_vl", "qwen2_vl", "llava")


def example_module(name: str):
    spec = importlib.util.spec_from_file_location(f"vlm_example_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_models(root: Path) -> dict[str, Path]:
    """Both tiny VLMs (with processors) under ``root``."""
    build = example_module("build")
    out = {}
    for family in FAMILIES:
        out[family] = root / family
        build.FAMILIES[family](out[family])
    return out


def write_rows(root: Path, n: int, seed: int = 0) -> Path:
    """``n`` image-text chat rows (one and two images, multi-turn) as ``root/train.jsonl``."""
    rows = example_module("data").make_rows(root, n, seed)
    path = root / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
