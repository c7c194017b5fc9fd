"""The HuggingFace model both backends start from: seeded random init from the planned config, or
the pretrained weights; and the AdamW parameter groups."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from toolkit.plan import Plan


def build_model(plan: Plan) -> torch.nn.Module:
    """The HF causal LM in fp32: seeded random init from its config, or its pretrained weights.

    Every rank builds the same model (same seed), so a run at any DP size starts from the same weights
    as the single-process reference.
    """
    cfg, hf_config = plan.config, plan.model.hf_config()
    if cfg.model.init == "pretrained":
        model = AutoModelForCausalLM.from_pretrained(_model_dir(cfg.model.name_or_path), config=hf_config,
                                                     dtype=torch.float32)
    else:
        torch.manual_seed(cfg.train.seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    if cfg.model.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model


def _model_dir(name_or_path: str) -> str:
    path = Path(name_or_path)
    return str(path.parent if path.is_file() else path)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only; biases and norm weights (1-D) are not decayed, as in Megatron and HF."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
