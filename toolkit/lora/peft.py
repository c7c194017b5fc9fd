"""LoRA through ``peft``: the plan's ``LoraSpec`` as peft's config, peft's names, its merge, the
model a DeepSpeed run trains (``apply_lora``: the built HF model wrapped before
``deepspeed.initialize``, as HF Trainer does) and the one skeleton of peft's model with no weights
(``peft_skeleton``) that the megatron path draws its adapters on and the exports and the converter
read names, scalings and saved keys from. peft is imported only where it is called.

Every backend draws the same adapter init: peft's own, from a CPU generator seeded with
(train.seed, "lora"), whatever the rank, device or dtype. At ZeRO-3 the base is built under
``zero.Init`` (weights already partitioned); peft's adapter layers are created afterwards as
ordinary tensors and ``deepspeed.initialize`` partitions them, each rank keeping its slice.

Names. peft nests the HF model as ``base_model.model.<hf name>``; an adapted layer ``q_proj`` holds
``q_proj.base_layer.weight`` (frozen) and ``q_proj.lora_A.default.weight`` [r, in],
``q_proj.lora_B.default.weight`` [out, r]; a module trained in full holds
``lm_head.modules_to_save.default.weight`` beside its frozen ``lm_head.original_module.weight``.
"""
from __future__ import annotations

import copy

import torch

from toolkit.lora.spec import LoraSpec, matches

ADAPTER = "default"
"""peft's adapter name (the one adapter a run trains)."""
PEFT_PREFIX = "base_model.model."


def peft_config(spec: LoraSpec):
    """peft's ``LoraConfig`` of a resolved spec."""
    from peft import LoraConfig
    return LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=spec.targets,
                      modules_to_save=spec.modules_to_save or None, fan_in_fan_out=spec.fan_in_fan_out,
                      bias="none", task_type="CAUSAL_LM")


def merged_weight(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float,
                  fan_in_fan_out: bool) -> torch.Tensor:
    """W + scaling x B @ A in fp32 (peft's merge): base [out, in] ([in, out] for Conv1D), A [r, in],
    B [out, r]."""
    delta = (b.float() @ a.float()) * scaling
    return base.float() + (delta.T if fan_in_fan_out else delta)


# --- the model a run trains, and peft's skeleton of it -------------------------------------------

def apply_lora(model: torch.nn.Module, spec: LoraSpec, seed: int) -> torch.nn.Module:
    """``model`` wrapped by peft: base frozen, adapters (and modules to save) trainable, in the
    model's dtype. The adapter init is drawn from (seed, "lora") alone, the same on every rank."""
    wrapped = _wrapped(model, peft_config(spec), seed)
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in wrapped.parameters() if p.requires_grad)
    if trainable != spec.trainable:  # the plan (estimate, dry-run, metrics) counted something else
        raise RuntimeError(f"LoRA: peft made {trainable:,} trainable parameters where the plan counted "
                           f"{spec.trainable:,} (targets {spec.targets}, modules_to_save {spec.modules_to_save})")
    return wrapped


def peft_skeleton(hf_config, config, seed: int | None = None) -> torch.nn.Module:
    """peft's model (``config``: peft's ``LoraConfig``) of the HF model of ``hf_config`` with no
    weights: the base on the meta device (``families/meta.py``). Without ``seed`` the adapters are
    on the meta device too (names, shapes, scalings, saved keys). With ``seed`` they are real,
    drawn as ``apply_lora`` draws them (the same generator, seed and module order): the adapted
    layers' weights are then zero-strided CPU views (peft reads their shapes; no memory), so peft
    makes their adapters on the CPU rather than on the meta device."""
    from toolkit.families.meta import meta_model
    config = copy.deepcopy(config)
    config.base_model_name_or_path = None  # peft warns where the config's base differs from the model's
    skeleton = meta_model(hf_config)
    if seed is None:
        from accelerate import init_empty_weights
        from peft import get_peft_model
        with init_empty_weights():
            return get_peft_model(skeleton, config, autocast_adapter_dtype=False)
    for name, module in skeleton.named_modules():
        weight = getattr(module, "weight", None)
        if any(matches(name, t) for t in config.target_modules) and isinstance(weight, torch.Tensor):
            module.weight = torch.nn.Parameter(torch.zeros(()).expand(weight.shape), requires_grad=False)
    return _wrapped(skeleton, config, seed)


def _wrapped(model: torch.nn.Module, config, seed: int) -> torch.nn.Module:
    from peft import get_peft_model

    from toolkit.parallel import unit_seed
    with torch.random.fork_rng(devices=[]):  # the CPU generator only: peft draws adapters on the CPU
        torch.random.default_generator.manual_seed(unit_seed(seed, "lora"))  # GPU streams left alone
        return get_peft_model(model, config, autocast_adapter_dtype=False)


def draw_adapters(hf_config, spec: LoraSpec, seed: int) -> dict[str, torch.Tensor]:
    """Every adapter matrix of the model in HF shapes, by HF-PEFT name, as ``apply_lora`` draws it,
    without building the model's weights (the megatron path splits them over TP)."""
    wrapped = peft_skeleton(hf_config, peft_config(spec), seed)
    return {n: p.detach() for n, p in wrapped.named_parameters() if p.requires_grad}


# --- names ------------------------------------------------------------------------------------------

def peft_names(module: str) -> tuple[str, str]:
    """HF-PEFT names (in peft's model, adapter ``default``) of an HF module's A and B."""
    return (f"{PEFT_PREFIX}{module}.lora_A.{ADAPTER}.weight", f"{PEFT_PREFIX}{module}.lora_B.{ADAPTER}.weight")


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


def lora_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, layer) of a peft model's LoRA layers that carry the run's adapter."""
    from peft.tuners.lora import LoraLayer
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer) and ADAPTER in m.scaling]
