"""The model as every part of a run sees it, derived once from its HF config: dimensions, parameter
counts by where they live, mixture-of-experts shape. The estimate, FLOPs/MFU, the checkpoint's
metadata and the engines all read this one derivation (``toolkit.families.attention_dims`` is the
one place head counts and widths come from)."""
from __future__ import annotations

import json
import re

from pydantic import BaseModel, ConfigDict

from toolkit.config import ConfigError


class ModelSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    hf: dict
    """The HF config as ``config.json`` holds it (JSON types: what a checkpoint's config.json is)."""
    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp_width: int
    glu: bool
    vocab: int
    tied: bool
    embedding: int
    """Parameters of the input embedding."""
    output: int
    """Of the LM head when untied, else 0."""
    per_layer: list[int]
    per_layer_matrices: list[int]
    """Of each layer's parameters, the 2-D ones (TP splits these; norms are replicated)."""
    per_layer_experts: list[int]
    """Mixture of experts: each layer's routed experts' parameters (part of per_layer_matrices)."""
    other: int
    """Final norm, learned positions."""
    quantized: int = 0
    """Weights of the linear layers a 4-bit base holds in 4 bits (``model.quantize``: ``quant.quantized_modules``)."""
    experts: int = 0
    """Routed experts per MoE layer (0: a dense model)..."""
    experts_per_token: int = 0
    """...of which each token uses this many."""
    vision: int = 0
    """A vision-language model's vision tower (``families/vision.py``; its projector not included)."""
    projector: int = 0
    """...and its projector from the tower into the language model."""
    vision_unused: int = 0
    """Of ``vision``: parameters the forward never reaches (always frozen: ``families/vision.py``)."""
    tower: dict | None = None
    """A vision-language model's tower dimensions (``families.vision.tower_shape``: the estimate reads them)."""
    code_dir: str | None = None
    """The model directory whose own Python defines the model's classes (``model.trust_remote_code``:
    its config.json's ``auto_map``); None: transformers' own classes."""

    @property
    def total(self) -> int:
        return self.embedding + self.output + sum(self.per_layer) + self.other + self.vision + self.projector

    @property
    def moe_layers(self) -> int:
        """Layers with routed experts."""
        return sum(1 for n in self.per_layer_experts if n)

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def hf_config(self):
        """A transformers ``PretrainedConfig`` of this model (built from ``hf``; nothing is read but, for a
        model of its own code, its trusted directory's configuration class)."""
        if self.code_dir is not None:
            from transformers.dynamic_module_utils import get_class_from_dynamic_module
            return get_class_from_dynamic_module(self.hf["auto_map"]["AutoConfig"], self.code_dir).from_dict(self.hf)
        from transformers import AutoConfig
        return AutoConfig.for_model(**self.hf)


def model_spec(hf_config, code_dir: str | None = None) -> ModelSpec:
    """Derive the spec; parameters are counted on the HF model built on the meta device (no memory).
    ``code_dir``: the trusted directory ``hf_config``'s class came from (``model.trust_remote_code``)."""
    from toolkit.families import attention_dims
    from toolkit.families.meta import meta_model
    from toolkit.families.vision import find_vision, tower_shape
    model = meta_model(hf_config)
    text = hf_config.get_text_config()  # a vision-language model's dimensions live in its text config
    counts = _parameter_counts(model, text.num_hidden_layers, find_vision(hf_config.model_type))
    heads, kv_heads, head_dim = attention_dims(text)
    act = str(getattr(text, "hidden_act", getattr(text, "activation_function", "gelu")))
    mlp = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * text.hidden_size
    moe = any(counts["per_layer_experts"])
    return ModelSpec(hf=json.loads(hf_config.to_json_string(use_diff=False)), model_type=hf_config.model_type,
                     layers=text.num_hidden_layers,
                     hidden=text.hidden_size, heads=heads, kv_heads=kv_heads, head_dim=head_dim, mlp_width=mlp,
                     glu="silu" in act or "swiglu" in act, vocab=text.vocab_size, **counts,
                     quantized=_quantized_weights(model), experts=_routed_experts(text) if moe else 0,
                     experts_per_token=int(getattr(text, "num_experts_per_tok", 0) or 0) if moe else 0,
                     tower=tower_shape(hf_config) if find_vision(hf_config.model_type) else None, code_dir=code_dir)


def _parameter_counts(model, layers: int, vision=None) -> dict:
    from toolkit.families.vision import is_frozen
    """By where parameters live; a vision-language model's tower and projector apart (``vision``: its
    ``families.vision`` entry), so their blocks never count as decoder layers."""
    emb, out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    tied = emb is out
    per_layer, matrices, experts, other = [0] * layers, [0] * layers, [0] * layers, 0
    parts = {"vision": 0, "projector": 0, "vision_unused": 0}
    for name, p in model.named_parameters():  # tied weights are listed once
        if p is emb or p is out:
            continue
        if vision is not None and (vision.is_tower(name) or vision.is_projector(name)):
            parts["vision" if vision.is_tower(name) else "projector"] += p.numel()
            parts["vision_unused"] += p.numel() if is_frozen(name, vision, model.config, False) else 0
            continue
        layer = re.search(r"\.(\d+)\.", name)
        if layer is None:
            other += p.numel()
            continue
        i = int(layer.group(1))
        per_layer[i] += p.numel()
        matrices[i] += p.numel() if p.ndim >= 2 else 0
        experts[i] += p.numel() if ".experts." in name else 0  # transformers' routed experts
    return {"embedding": emb.numel(), "output": 0 if tied else out.numel(), "tied": tied, "per_layer": per_layer,
            "per_layer_matrices": matrices, "per_layer_experts": experts, "other": other, **parts}


def _quantized_weights(model) -> int:
    from toolkit.lora.quant import quantized_modules
    return sum(model.get_submodule(name).weight.numel() for name in quantized_modules(model))


def _routed_experts(hf_config) -> int:
    """transformers' MoE configs name it num_local_experts (Mixtral) or num_experts (Qwen-MoE, OLMoE)."""
    return int(getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None) or 0)


def read_config_json(name_or_path: str) -> dict | None:
    """``config.json`` as written (no class defaults filled in), or None where there is no such file."""
    import json
    from pathlib import Path
    path = Path(name_or_path)
    path = path if path.suffix == ".json" else path / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def load_hf_config(name_or_path: str, trust_remote_code: bool = False):
    """The HF config of ``model.name_or_path`` (a directory holding config.json, or the file). A
    directory whose config.json needs its own Python is refused unless ``trust_remote_code``."""
    from pathlib import Path

    from transformers import AutoConfig

    from toolkit import remote_code
    path = Path(name_or_path)
    if path.is_file() and path.name.endswith(".json"):
        path = path.parent
    try:
        return AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        if remote_code.is_custom_code_refusal(exc):
            raise remote_code.refusal("model.name_or_path", name_or_path, path, "config.json") from None
        raise ConfigError(f"model.name_or_path={name_or_path!r}: cannot read an HF config there ({exc}); "
                          "give a local directory holding config.json (and weights for model.init=pretrained)") from None


def model_code_dir(name_or_path: str, hf_config) -> str | None:
    """The directory of a model whose classes its own (trusted) code defines; None for transformers' own."""
    from pathlib import Path

    from toolkit.remote_code import runs_remote_code
    if not runs_remote_code(hf_config):
        return None
    path = Path(name_or_path)
    return str((path.parent if path.is_file() else path).resolve())
