"""PyTorch distributed checkpoints (DCP) of an FSDP2 model with HF names: write (``convert --to dcp``,
and ``--to accelerate``: the same state dicts in accelerate's / HF Trainer's ``checkpoint-N/`` layout).

The output is what ``torch.distributed.checkpoint.save`` writes for
``{"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}`` of an
FSDP2 model trained with ``torch.optim.AdamW``, written by DCP's own ``FileSystemWriter`` as one
writer rank (``no_dist``): ``__0_{i}.distcp`` (a file per tensor) and ``.metadata``, plus the model's
``config.json``.
DCP reshards on load, so ``dcp.load`` + ``set_model_state_dict`` / ``set_optimizer_state_dict``
read it at any world size. The keys are those of the nested state dict (DCP's planner flattens it):
  ``model.<HF state-dict name>``     every tensor of ``model.state_dict()`` (a tied ``lm_head.weight`` too)
  ``optim.state.<param>.{exp_avg,exp_avg_sq,step}``  fp32 moments, ``step`` a 0-dim fp32 tensor
  ``optim.param_groups.{0,1}.*``     torch AdamW's group keys: group 0 the matrices (decayed),
                                     group 1 the 1-D biases and norms (weight decay 0), as the
                                     toolkit's trainer groups them (``adapters/hf.param_groups``)

Streamed: the state dict handed to DCP holds meta tensors only; the planner reads each tensor from
the source when DCP's writer asks for it (``resolve_data``), so a few tensors are in memory at a time
(370M-parameter HF model -> DCP: 0.6 GB peak RSS, the model 1.4 GB).
Without moments (an HF source, ``--weights-only``) Adam starts fresh: zero moments, step 0.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from toolkit.formats.canonical import Source, WriteRequest, hf_config_object
from toolkit.formats.describe import ACCELERATE_MODEL, ACCELERATE_OPTIM
from toolkit.formats.errors import ConvertError
from toolkit.formats.pages import SourceMaps, give_back

MOMENTS = ("exp_avg", "exp_avg_sq")


def write(source: Source, out: Path, request: WriteRequest, progress=None) -> dict:
    """The table's writer (``table.Format.write``): ``model`` and ``optim`` in one DCP directory."""
    model, optim, lazy = dcp_state(source, request)
    save_lazy({"model": model, "optim": optim}, lazy, out, progress, SourceMaps(source.path))
    (Path(out) / "config.json").write_text(json.dumps(source.hf_config, indent=2, sort_keys=True))
    return {"dp": 1}


def write_accelerate(source: Source, out: Path, request: WriteRequest, progress=None) -> dict:
    """The table's writer for ``--to accelerate``: an HF Trainer ``checkpoint-N/`` as accelerate's
    ``save_fsdp_model`` / ``save_fsdp_optimizer`` write it (``SHARDED_STATE_DICT``, FSDP2):
    ``pytorch_model_fsdp_0/`` (DCP of ``{"model": ...}``), ``optimizer_0/`` (DCP of
    ``{"optimizer": ...}``), plus what ``Trainer.train(resume_from_checkpoint=...)`` reads beside them:
    ``trainer_state.json`` (``global_step``), ``scheduler.pt`` (without it the Trainer skips loading
    the optimizer) and ``config.json``."""
    model, optim, lazy = dcp_state(source, request)
    out, maps = Path(out), SourceMaps(source.path)
    save_lazy({"model": model}, {k: f for k, f in lazy.items() if k.startswith("model.")}, out / ACCELERATE_MODEL,
              progress, maps)
    save_lazy({"optimizer": optim}, rekey(lazy, "optim", "optimizer"), out / ACCELERATE_OPTIM, progress, maps)
    step = int(source.step or 0) if source.has_optimizer and not request.weights_only else 0
    _trainer_files(out, step, [g["initial_lr"] for g in optim["param_groups"]])
    (out / "config.json").write_text(json.dumps(source.hf_config, indent=2, sort_keys=True))
    return {"dp": 1}


def _trainer_files(out: Path, step: int, lrs: list[float]) -> None:
    """``trainer_state.json`` (a transformers ``TrainerState`` at ``step``) and ``scheduler.pt``: the
    state of the ``LambdaLR`` every transformers schedule is, ``step`` steps in (the schedule's own
    function and base learning rates are the resuming Trainer's; its learning rates follow from the step)."""
    from transformers.trainer_callback import TrainerState
    TrainerState(global_step=step).save_to_json(str(out / "trainer_state.json"))
    groups = [torch.zeros(1) for _ in lrs]
    opt = torch.optim.AdamW([{"params": [p], "lr": lr} for p, lr in zip(groups, lrs)])
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    state = schedule.state_dict()
    state.update(last_epoch=step, _step_count=step + 1, _last_lr=list(lrs))
    del state["base_lrs"]  # LambdaLR.load_state_dict keeps the resuming run's own (its peak learning rates)
    torch.save(state, out / "scheduler.pt")


def dcp_state(source: Source, request: WriteRequest) -> tuple[dict, dict, dict[str, Callable]]:
    """(model state dict, optimizer state dict, loaders): both as ``get_model_state_dict`` /
    ``get_optimizer_state_dict`` give them, every tensor a meta tensor of the written shape and dtype;
    ``loaders[flat key]`` reads it (flat keys are ``model.<name>`` and ``optim.state.<name>.<state>``;
    ``rekey`` renames them for another top-level key)."""
    modules = _module_params(source)
    names = _state_dict_names(source, modules)
    weight = request.dtype
    model, lazy = {}, {}
    for name in names:
        module = name if name in modules else "model.embed_tokens.weight"  # a tied lm_head.weight
        shape, pieces = modules[module]
        dtype = weight or _dtype(source, shape, pieces)
        model[name] = torch.empty(shape, dtype=dtype, device="meta")
        lazy[f"model.{name}"] = _loader(source, shape, pieces, "param", dtype)
    moments = source.has_optimizer and not request.weights_only
    step = float(source.step or 0) if moments else 0.0
    state = {}
    for module, (shape, pieces) in modules.items():
        state[module] = {"step": torch.tensor(step, dtype=torch.float32)}
        for key in MOMENTS:
            state[module][key] = torch.empty(shape, dtype=torch.float32, device="meta")
            lazy[f"optim.state.{module}.{key}"] = (_loader(source, shape, pieces, key, torch.float32) if moments
                                                   else _zeros(shape))
    return model, {"state": state, "param_groups": _param_groups(source, modules)}, lazy


def save_lazy(state_dict: dict, lazy: dict[str, Callable], out: Path, progress=None,
              maps: SourceMaps | None = None) -> None:
    """``dcp.save(state_dict)`` in this process, with DCP's own ``FileSystemWriter``; each meta
    tensor is read by ``lazy[flat key]()`` when the writer reaches it, after the heap's free pages
    and the source's mapped pages are given back (``pages.give_back``: the tensors written before)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    Path(out).mkdir(parents=True, exist_ok=True)
    # a file per tensor: FileSystemWriter keeps every tensor of a file alive until the file is done
    # (torch 2.13 filesystem.py: ``tensor_dict``), so one file per rank would hold the whole model
    writer = dcp.FileSystemWriter(str(out), single_file_per_rank=False, thread_count=1)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state_dict, storage_writer=writer, planner=_LazyPlanner(lazy, progress, maps), no_dist=True)


def rekey(lazy: dict[str, Callable], old: str, new: str) -> dict[str, Callable]:
    """The loaders of keys under ``old.`` renamed under ``new.`` (accelerate saves ``{"optimizer": ...}``)."""
    return {new + k[len(old):]: f for k, f in lazy.items() if k.startswith(old + ".")}


class _LazyPlanner:
    """DCP's ``DefaultSavePlanner`` whose tensors are read from the source on demand."""

    def __new__(cls, lazy, progress, maps):
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        class LazyPlanner(DefaultSavePlanner):
            def lookup_object(self, index):
                if index.fqn in lazy:
                    give_back(maps)
                    tensor = lazy[index.fqn]()
                    if progress:
                        progress(index.fqn, tensor.nbytes)
                    return tensor
                return super().lookup_object(index)
        return LazyPlanner()


def _state_dict_names(source: Source, modules: dict) -> list[str]:
    """The HF model's ``state_dict`` names (a meta-device model of the config), each held by the source."""
    from toolkit.families.meta import meta_model
    model = meta_model(hf_config_object(source.hf_config))
    names = list(model.state_dict())
    unknown = [n for n in names if n not in modules and not (source.tied and n == "lm_head.weight")]
    if unknown:
        raise ConvertError(f"{source.path}: the HF {source.model_type} model's state dict has {unknown[:6]}, which "
                           "the source does not hold (wrong --hf-config?)")
    return names


def _module_params(source: Source) -> dict:
    from toolkit.formats.zero import _module_params as module_params  # the transformers module's parameters
    return module_params(source)


def _dtype(source: Source, shape, pieces) -> torch.dtype:
    from toolkit.formats.zero import _dtype as dtype
    return dtype(source, shape, pieces)


def _loader(source: Source, shape, pieces, state: str, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    from toolkit.formats.zero import _assemble

    def load() -> torch.Tensor:
        return _assemble(source, shape, pieces, state).to(dtype).contiguous()
    return load


def _zeros(shape) -> Callable[[], torch.Tensor]:
    return lambda: torch.zeros(shape, dtype=torch.float32)


def _param_groups(source: Source, modules: dict) -> list[dict]:
    """torch AdamW's two groups (every key its ``param_groups`` hold, so a ``dcp.load`` into any AdamW
    finds them), hyperparameters from the source where it recorded them, else AdamW's defaults."""
    defaults = {k: v for k, v in torch.optim.AdamW([torch.zeros(1)]).param_groups[0].items() if k != "params"}
    hp = {**defaults, **{k: (tuple(v) if k == "betas" else v) for k, v in source.optimizer_hparams.items()
                         if k in defaults}}
    hp["initial_lr"] = hp["lr"]  # a learning-rate scheduler's key (its own state lies elsewhere)
    decay = [m for m, (shape, _) in modules.items() if len(shape) >= 2]
    flat = [m for m, (shape, _) in modules.items() if len(shape) < 2]
    return [{**hp, "weight_decay": _decay_rate(source, hp["weight_decay"]), "params": decay},
            {**hp, "weight_decay": 0.0, "params": flat}]


def _decay_rate(source: Source, first_group: float) -> float:
    """The matrices' weight decay: a megatron source's groups each carry theirs (its no-decay group
    may come first), other sources record their first group's."""
    groups = getattr(source, "param_groups", None) or []
    return max([float(g.get("weight_decay", 0.0)) for g in groups] or [first_group])

