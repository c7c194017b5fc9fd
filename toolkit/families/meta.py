"""The HF model with no storage: every parameter on the meta device. The plan counts parameters
and resolves LoRA on it, the adapters materialize it, peft's skeleton (``toolkit/lora/peft.py``)
wraps it, the exports and the converter read names and shapes off it. One builder, so every one of
them sees the same model: tied weights tied, buffers real."""
from __future__ import annotations

import torch


def auto_class(hf_config):
    """transformers' auto class of the model: ``AutoModelForImageTextToText`` for a vision-language model
    (a ``vision_config`` beside its text config; ``AutoModelForCausalLM`` refuses those), else the causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from toolkit.families.vision import is_vision_config
    return AutoModelForImageTextToText if is_vision_config(hf_config) else AutoModelForCausalLM


def meta_model(hf_config, **from_config) -> torch.nn.Module:
    """``auto_class(hf_config).from_config(hf_config, **from_config)`` with its parameters on the meta
    device (accelerate's ``init_empty_weights``; buffers such as RoPE's stay real and small) and the
    config's tied weights tied again (under ``init_empty_weights`` transformers 5 unties them, and the
    plan tells a tied LM head by ``input.weight is output.weight``)."""
    from accelerate import init_empty_weights

    from toolkit.remote_code import runs_remote_code
    with init_empty_weights(include_buffers=False):  # a config of a trusted directory's class: its model too
        model = auto_class(hf_config).from_config(hf_config, trust_remote_code=runs_remote_code(hf_config),
                                                  **from_config)
    model.tie_weights()
    return model


def module_names(hf_config, checkpoint_names: list[str]) -> dict[str, str]:
    """Checkpoint name -> module name for a vision-language checkpoint written by transformers'
    ``save_pretrained`` (hub names such as ``language_model.model.layers.0...``), by transformers' own renaming
    rules for the model (``get_model_conversion_mapping``, applied as ``from_pretrained`` applies them). Raises
    ValueError where a rule is more than a rename (a fused or split tensor)."""
    from transformers.conversion_mapping import WeightRenaming, get_model_conversion_mapping
    from transformers.core_model_loading import rename_source_key
    model = meta_model(hf_config)
    rules = get_model_conversion_mapping(model)
    if any(not isinstance(r, WeightRenaming) for r in rules):
        raise ValueError(f"{hf_config.model_type}: transformers converts some tensors of this checkpoint beyond renaming")
    renames, state = list(rules), model.state_dict()
    return {n: rename_source_key(n, renames, [], model.base_model_prefix, state)[0] for n in checkpoint_names}
