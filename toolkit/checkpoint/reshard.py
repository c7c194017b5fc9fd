"""Resume from a checkpoint written at another layout (DP size, ZeRO stage, TP/PP, even the other
backend): the engine reshards on load where it can (megatron's torch_dist), otherwise the
converter writes the checkpoint at this run's layout first. Also refuses another model's checkpoint.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch.distributed as dist

from toolkit.layout import Layout
from toolkit.storage import meta
from toolkit.storage.rundir import RunDirError

START_OVER = ("start a new run here with --resume never (the checkpoints are moved to RUN_DIR/set_aside/, nothing "
              "is deleted)")

# Config fields that fix the shapes of the weights: a checkpoint differing in any is another model.
SHAPE_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size", "tie_word_embeddings")
TARGET_FORMAT = {"deepspeed": "zero", "megatron": "megatron"}


def check_same_model(ckpt: Path, ours: dict) -> None:
    """Raise naming every field where the checkpoint's model differs from this run's (``ours``: the
    HF config as a dict)."""
    saved = meta.read_hf_config(ckpt)
    diff = [f"{k}: checkpoint {saved.get(k)!r}, this run {ours.get(k)!r}" for k in SHAPE_FIELDS
            if k in saved and k in ours and saved[k] != ours[k]]
    if diff:
        raise RunDirError(f"checkpoint {ckpt} holds another model ({'; '.join(diff)}); point run_dir at this "
                          f"model's run, or {START_OVER}")


def check_same_lora(ckpt: Path, saved_meta: dict, lora: dict | None, base: dict | None) -> None:
    """A LoRA checkpoint holds the adapters only: it resumes on the same frozen base, with the same
    adapter shapes (at any DP size and stage: the engine reshards it). Full and LoRA checkpoints
    never stand in for each other. ``lora``/``base``: this run's (``LoraSpec`` dict, ``meta.base_model_record``)."""
    saved = saved_meta.get("lora")
    if saved is None and lora is None:
        return
    fix = f"point run_dir at a new directory, or {START_OVER}"
    if saved is None:
        raise RunDirError(f"checkpoint {ckpt} is a full fine-tuning checkpoint and this run trains LoRA adapters "
                           f"(lora.rank={lora['rank']}); to fine-tune that model with LoRA, export it (toolkit convert "
                           f"--to hf) and use it as model.name_or_path; or {fix}")
    if lora is None:
        raise RunDirError(f"checkpoint {ckpt} holds LoRA adapters only (lora.rank={saved['rank']}) and this run "
                           f"trains the whole model (lora.rank=0); resume with the checkpoint's lora.* settings, or {fix}")
    ours, theirs = saved_meta.get("base_model", {}), base or {}
    if theirs.get("fingerprint") != ours.get("fingerprint"):
        raise RunDirError(f"checkpoint {ckpt} holds LoRA adapters trained on another base model: checkpoint's base "
                           f"{ours.get('path')} ({ours.get('fingerprint')}), this run's {theirs.get('path')} "
                           f"({theirs.get('fingerprint')}); set model.name_or_path to the checkpoint's base, or {fix}")
    if theirs.get("quantization") != ours.get("quantization"):  # the adapters would meet another function
        raise RunDirError(f"checkpoint {ckpt} holds LoRA adapters trained on a base quantized as "
                          f"{_quantization(ours)}; this run's base is {_quantization(theirs)}; set model.quantize and "
                          f"model.quantize_double as the checkpoint's, or {fix}")
    shape = ("rank", "targets", "modules_to_save")
    diff = [f"{k}: checkpoint {saved.get(k)!r}, this run {lora.get(k)!r}" for k in shape if saved.get(k) != lora.get(k)]
    if diff:
        raise RunDirError(f"checkpoint {ckpt} holds other LoRA adapters ({'; '.join(diff)}); set lora.* as the "
                           f"checkpoint's, or {fix}")


def _quantization(base: dict) -> str:
    q = base.get("quantization")
    return "unquantized (model.quantize=none)" if q is None else \
        f"{q['quant_type']} (model.quantize={q['quant_type']}, model.quantize_double={str(q['double_quant']).lower()})"


def engine_state_dir(ckpt: Path, saved_layout: dict, engine, backend: str, run_dir: Path, rank: int,
                     note=print) -> tuple[Path, str]:
    """Where this run's engine should load from, and how: the checkpoint itself when the layout
    matches ("as saved") or the engine reshards on load ("resharded"), else a conversion to this
    layout under ``RUN_DIR/resharded/`` ("converted"; made once by rank 0 with the converter;
    collective)."""
    layout = engine.layout_record()
    if saved_layout == layout:
        return ckpt / "engine", "as saved"
    if engine.can_load_layout(saved_layout):
        note(f"resharding {ckpt.name} from {saved_layout} to {layout} on load")
        return ckpt / "engine", "resharded"
    out = run_dir / "resharded" / f"{ckpt.name}-{_tag(layout)}"
    error = None
    if rank == 0 and not out.exists():  # the converter stages its output: `out` exists only complete
        note(f"converting {ckpt.name} from {saved_layout} to {layout} (toolkit convert) before loading")
        error = _convert(ckpt, out, backend, engine.lay)
    outcome = [error]  # rank 0's conversion error (or None), for every rank
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0]:  # this run's layout cannot take that checkpoint: the same on every attempt
        raise RunDirError(outcome[0])
    return out / "engine", "converted"


def drop_conversion(engine_dir: Path, run_dir: Path, rank: int) -> None:
    """Remove a conversion once every rank has loaded it (the next checkpoint supersedes it)."""
    dist.barrier()
    if rank == 0 and engine_dir.parent.parent == run_dir / "resharded":
        shutil.rmtree(engine_dir.parent, ignore_errors=True)


def _convert(ckpt: Path, out: Path, backend: str, layout: Layout) -> str | None:
    """The checkpoint at this run's ``layout`` (``Layout.for_checkpoint``: its sizes, and on megatron its
    vocabulary divisor, so the converted embedding has the rows this run's model has)."""
    from toolkit.convert import convert
    from toolkit.formats.errors import ConvertError
    try:
        convert(ckpt, out, to=TARGET_FORMAT[backend], layout=layout.for_checkpoint())
    except ConvertError as exc:
        return (f"checkpoint {ckpt} was written with another layout and cannot be converted to this run's "
                f"{layout.record()}: {exc}")
    return None


def _tag(layout: dict) -> str:
    return "-".join(f"{k}{v}" for k, v in sorted(layout.items()) if v is not None)
