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
