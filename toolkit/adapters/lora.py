"""LoRA on the DeepSpeed path, through ``peft``: the plan's ``LoraSpec`` applied to the built HF model
(before ``deepspeed.initialize``, as HF Trainer does), what saves and exports need to know of it,
and an adapter-only checkpoint made loadable at another DP size or ZeRO stage (``to_universal``).

At ZeRO-3 the base model is built under ``zero.Init`` (its weights already partitioned); peft's
adapter layers are created afterwards as ordinary tensors and ``deepspeed.initialize`` partitions
them, each rank keeping its slice of its own copy. Every rank therefore draws the same adapter init:
from a CPU generator seeded with (train.seed, "lora"), whatever the rank, device or dtype.

Names. peft nests the HF model as ``base_model.model.<hf name>``; an adapted layer ``q_proj`` holds
``q_proj.base_layer.weight`` (frozen) and ``q_proj.lora_A.default.weight`` [r, in],
``q_proj.lora_B.default.weight`` [out, r]; a module trained in full holds
``lm_head.modules_to_save.default.weight`` beside its frozen ``lm_head.original_module.weight``.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from toolkit.plan.lora import ADAPTER, PEFT_PREFIX, LoraSpec, peft_config

__all__ = ["ADAPTER", "PEFT_PREFIX", "apply_lora", "peft_config", "hf_name", "trainable_names",
           "saved_layout", "to_universal"]

def apply_lora(model: torch.nn.Module, spec: LoraSpec, seed: int) -> torch.nn.Module:
    """``model`` wrapped by peft: base frozen, adapters (and modules to save) trainable, in the
    model's dtype. The adapter init is drawn from (seed, "lora") alone, the same on every rank."""
    from peft import get_peft_model

    from toolkit.adapters.hf import unit_seed
    with torch.random.fork_rng(devices=[]):  # the CPU generator only: peft draws adapters on the CPU
        torch.random.default_generator.manual_seed(unit_seed(seed, "lora"))  # GPU streams left alone
        wrapped = get_peft_model(model, peft_config(spec), autocast_adapter_dtype=False)
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in wrapped.parameters() if p.requires_grad)
    if trainable != spec.trainable:  # the plan (estimate, dry-run, metrics) counted something else
        raise RuntimeError(f"LoRA: peft made {trainable:,} trainable parameters where the plan counted "
                           f"{spec.trainable:,} (targets {spec.targets}, modules_to_save {spec.modules_to_save})")
    return wrapped


def trainable_names(module: torch.nn.Module) -> list[str]:
    """Names (as ``module.named_parameters`` gives them) of what a LoRA run trains and checkpoints."""
    return [n for n, p in module.named_parameters() if p.requires_grad]


def hf_name(peft_name: str) -> str | None:
    """The HF checkpoint name a peft parameter stands for in the merged model: the base layer's
    weight and a module to save's trained copy under the HF name; None for adapter matrices and
    the frozen originals of modules to save (the merge consumes or replaces them)."""
    name = peft_name.removeprefix(PEFT_PREFIX)
    if f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name or ".original_module." in name:
        return None
    return name.replace(".base_layer.", ".").replace(f".modules_to_save.{ADAPTER}.", ".")


# --- resuming at another DP size or ZeRO stage ---------------------------------------------------

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
    tag = (engine_dir / "latest").read_text().strip()
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
