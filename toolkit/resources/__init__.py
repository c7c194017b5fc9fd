"""Files the toolkit ships inside the package, found through ``importlib.resources`` so that an
installed wheel works as a checkout does:

  deepspeed/*.json   DeepSpeed configs as users write them (``zero.ds_config=zero2``)
  megatron/*.yaml    Megatron layout presets (``megatron.preset=tp2_sp``)
  constraints.txt    the one tested version matrix (``toolkit doctor`` compares against it)

In a checkout, the top-level ``ds_configs/``, ``megatron_configs/`` and
``requirements/constraints.txt`` are links to these files: one copy, nothing to keep in sync.
"""
from __future__ import annotations

from importlib.resources import files
from importlib.resources.abc import Traversable

PRESET_KINDS = {"deepspeed": ".json", "megatron": ".yaml"}


def presets(kind: str) -> dict[str, Traversable]:
    """The shipped presets of ``kind`` (deepspeed | megatron) by name (file stem)."""
    suffix = PRESET_KINDS[kind]
    folder = files(__name__) / kind
    return {f.name.removesuffix(suffix): f for f in folder.iterdir() if f.name.endswith(suffix)}


def preset(kind: str, name: str) -> Traversable | None:
    """A shipped preset by name, with or without its suffix; None when there is none."""
    return presets(kind).get(name.removesuffix(PRESET_KINDS[kind]))


def constraints() -> str:
    return (files(__name__) / "constraints.txt").read_text()
