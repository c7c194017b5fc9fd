"""A DeepSpeed LoRA run resumed at another DP size or ZeRO stage: its adapter-only checkpoint made
loadable there (``to_universal``). The model itself is ``lora/peft.py``'s ``apply_lora``.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

__all__ = ["saved_layout", "to_universal"]


def saved_layout(engine_dir: Path) -> dict | None:
    """The layout a toolkit checkpoint's engine state was written at (its meta.json), if recorded."""
    from toolkit.storage import meta
    try:
        return meta.read_meta(engine_dir.parent)["layout"]
    except (OSError, KeyError, ValueError):
        return None


def to_universal(engine_dir: Path, out: Path) -> None:
    """``engine_dir``'s newest tag through ``ds_to_universal`` into ``out/<tag>``, with the
    ``latest``/``latest_universal`` pointers ``_load_checkpoint`` reads; one process, no pool."""
    from argparse import Namespace

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    from toolkit.storage import read_tag
    tag = read_tag(engine_dir / "latest")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    ds_to_universal(Namespace(input_folder=str(engine_dir / tag), output_folder=str(out / tag), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True))
    _as_toolkit_universal(out / tag)
    for latest in ("latest", "latest_universal"):
        (out / latest).write_text(tag)


def _as_toolkit_universal(tag_dir: Path) -> None:
    """ds_to_universal's output in the form the toolkit's own universal writer has (``formats/zero.py``),
    which every stage loads: both model-states names (stages 1-2 and 3 look for their own; the
    counters only), each state file ``{"param": tensor}`` in the parameter's shape (a stage-3 source
    gives flat tensors), a ``step.pt`` per parameter (stages 1-2 read it) and ``zero/optimizer_state.pt``
    with empty param groups (DeepSpeed copies saved groups over the engine's, FusedAdam's ``step``
    in them included) and Adam's step where stage 3 reads it."""
    names = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
    have = next(tag_dir / n for n in names if (tag_dir / n).is_file())
    for name in names:
        if not (tag_dir / name).is_file():
            shutil.copyfile(have, tag_dir / name)
    shapes = {n: s for group in torch.load(have, weights_only=False)["param_shapes"] for n, s in group.items()}
    zero = tag_dir / "zero"
    saved = torch.load(zero / "optimizer_state.pt", weights_only=False)  # written just now by ds_to_universal
    steps = list(zero.glob("*/step.pt"))
    step = int(torch.load(steps[0], weights_only=False) if steps else saved["optimizer_state_dict"]["state"][0]["step"])
    for name, shape in shapes.items():
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            state = torch.load(zero / name / f"{key}.pt", weights_only=False)
            tensor = state["param"] if isinstance(state, dict) else state
            torch.save({"param": tensor.reshape(shape)}, zero / name / f"{key}.pt")
        torch.save(step, zero / name / "step.pt")
    from deepspeed import __version__ as ds_version  # a stage-3 source records none; stages 1-2 require one

    from toolkit.formats.zero import UNIVERSAL_GROUPS
    torch.save({"param_groups": [{} for _ in range(UNIVERSAL_GROUPS)], "ds_version": saved.get("ds_version", ds_version),
                "optimizer_state_dict": {"state": {0: {"step": step}}, "param_groups": [{}]}},
               zero / "optimizer_state.pt")
