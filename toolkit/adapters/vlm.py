"""Vision-language models on the DeepSpeed path (``docs/vlm.md``): what an ``AutoModelForImageTextToText``
needs beyond a causal LM, by its ``families/vision.py`` entry.

- ``prepare``: the vision tower frozen (``model.freeze_vision``; the projector trains) and, always, the
  tower parameters the forward never reaches (LLaVA's last CLIP layer and norm: trained, AdamW's decoupled
  weight decay would move them without a gradient); the toolkit's document attention on the **text**
  sub-config only (the tower's attention has its own shapes: given the text layout it fails).
- ``forward_inputs``: the micro-batch's ids, pixels, the ``TokenLayout`` and positions restarting per
  document: 1-D, or Qwen2.5-VL's 3-D M-RoPE made by the model's own ``get_rope_index`` on each document
  alone (a pure function of its tokens and image grids; 1-D positions there run and are wrong).
"""
from __future__ import annotations

import torch

from toolkit.adapters.attention import TokenLayout
from toolkit.families.vision import find_vision, frozen_prefixes, image_token_id, is_frozen


def is_vlm(model_or_config) -> bool:
    config = getattr(model_or_config, "config", model_or_config)
    return find_vision(getattr(config, "model_type", None)) is not None


def freeze(model: torch.nn.Module, freeze_vision: bool) -> None:
    """requires_grad off on the tower (unless ``freeze_vision`` is false) and on the unused parameters."""
    vision = find_vision(model.config.model_type)
    for name, param in model.named_parameters():
        if is_frozen(name, vision, model.config, freeze_vision):
            param.requires_grad_(False)


def describe_freeze(model: torch.nn.Module, freeze_vision: bool) -> str:
    """One line: what trains (a LoRA run: the adapters; peft froze the rest)."""
    config = _config(model)
    vision = find_vision(config.model_type)
    counts = {"frozen": 0, "trained": 0}
    for param in model.parameters():
        counts["trained" if param.requires_grad else "frozen"] += getattr(param, "ds_numel", param.numel())
    prefixes = frozen_prefixes(vision, config, freeze_vision)
    return (f"vision-language model {vision.model_type}: "
            f"{'vision tower frozen, projector trains' if freeze_vision else 'vision tower and projector train'}"
            f"{' (frozen ' + ', '.join(prefixes) + ')' if prefixes else ''}: "
            f"{counts['trained']:,} parameters trained, {counts['frozen']:,} frozen")


def use_text_document_attention(model: torch.nn.Module) -> None:
    """The toolkit's document attention on the language model only; the tower keeps its own."""
    from transformers import AttentionInterface

    from toolkit.adapters.hf_attention import ATTENTION, document_attention
    AttentionInterface.register(ATTENTION, document_attention)
    model.set_attn_implementation({"text_config": ATTENTION})
    text, tower = model.config.get_text_config(), model.config.vision_config
    if text._attn_implementation != ATTENTION or tower._attn_implementation == ATTENTION:
        raise RuntimeError(f"{type(model).__name__}: document attention must apply to the language model only "
                           f"(text: {text._attn_implementation}, vision: {tower._attn_implementation})")


def forward_inputs(mb: dict, model: torch.nn.Module) -> dict:
    """The forward's inputs of a micro-batch of rows packed by documents (``data/vision.py``)."""
    from toolkit.adapters.hf_attention import LAYOUT_KWARG
    layout = TokenLayout.of(mb["input_ids"], document_ids=mb["document_ids"])
    inputs = {"input_ids": mb["input_ids"], "pixel_values": mb["pixel_values"], LAYOUT_KWARG: layout}
    vision = find_vision(_config(model).model_type)
    if vision.positions == "mrope":
        inputs["image_grid_thw"] = mb["image_grid_thw"]
        inputs["position_ids"] = mrope_positions(model, mb)
    else:
        inputs["position_ids"] = layout.position_ids
    return inputs


def _config(model: torch.nn.Module):
    return getattr(model, "config", None) or model.module.config


def mrope_positions(model: torch.nn.Module, mb: dict) -> torch.Tensor:
    """``[3, b, s]`` M-RoPE positions, each document's from ``get_rope_index`` on it alone (with its own
    images' grids, taken in token order), zeros on the padded tail."""
    rope_index = next(m.get_rope_index for m in model.modules() if hasattr(m, "get_rope_index"))
    config = _config(model)
    image_id, merge = image_token_id(find_vision(config.model_type), config), config.vision_config.spatial_merge_size
    ids, docs, grids = mb["input_ids"], mb["document_ids"], mb["image_grid_thw"]
    per_image = (grids.prod(dim=1) // merge ** 2).tolist()
    out = torch.zeros(3, *ids.shape, dtype=torch.long, device=ids.device)
    next_image = 0
    for r in range(ids.shape[0]):
        for d in torch.unique(docs[r][docs[r] > 0]).tolist():
            where = (docs[r] == d).nonzero().flatten()
            doc = ids[r, where][None]
            is_image = (doc == image_id).int()
            tokens, first = int(is_image.sum()), next_image
            while tokens > 0:
                tokens -= per_image[next_image]
                next_image += 1
            positions, _ = rope_index(doc, is_image, grids[first:next_image] if next_image > first else None)
            out[:, r, where] = positions[:, 0].to(out.dtype)
    return out
