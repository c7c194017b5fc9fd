"""Vision-language models as data: per HF ``model_type``, where the vision tower and the projector live
in the ``AutoModelForImageTextToText`` module tree, which config fields name the image token and the
vision markers (never prediction targets), how positions are made, and which tower parameters the
forward never uses. No I/O, no communication: the adapters and the data read this table.

transformers 5.24's module names (the checkpoint names it writes differ, ``save_pretrained`` renames
both ways; a checkpoint with module names loads unchanged, which is what ``hf_final/`` holds)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Vision:
    model_type: str
    tower: str
    """Module prefix of the vision tower (frozen by ``model.freeze_vision``)."""
    projector: str
    """Module prefix of the projector into the language model (trained; may lie inside ``tower``)."""
    image_token: str
    """The config field holding the image placeholder's token id."""
    markers: tuple[str, ...] = ()
    """Config fields of tokens that frame an image (never targets)."""
    positions: str = "1d"
    """``1d``: positions restart per document; ``mrope``: 3-D M-RoPE per document (``get_rope_index``)."""
    seeded_init: bool = True
    """Whether the toolkit's piece-by-piece seeded init (``model.init=random``, ``adapters/hf.SeededWeights``)
    draws every parameter as HF's own init does; False: random init is refused (use a saved model)."""
    unused: Callable[[object], list[str]] | None = None
    """Module prefixes of tower parameters the forward never reaches (frozen always: a trained parameter
    without a gradient would still be moved by AdamW's decoupled weight decay)."""

    def is_tower(self, name: str) -> bool:
        """``name`` (a parameter or module name) lies in the tower and not in the projector."""
        return _under(name, self.tower) and not _under(name, self.projector)

    def is_projector(self, name: str) -> bool:
        return _under(name, self.projector)


def _under(name: str, prefix: str) -> bool:
    """``prefix`` in ``name`` on module boundaries (a peft wrapper adds ``base_model.model.`` before it)."""
    return name == prefix or name.startswith(prefix + ".") or f".{prefix}." in f".{name}."


def _llava_unused(hf_config) -> list[str]:
    """CLIP layers after ``vision_feature_layer`` and its ``post_layernorm``: LLaVA takes the hidden states
    of that layer (-2 in LLaVA-1.5), so the last layer and the final norm never run."""
    layer = hf_config.vision_feature_layer
    if not isinstance(layer, int):  # several layers concatenated: the deepest one decides
        layer = max(layer, key=lambda k: k % (hf_config.vision_config.num_hidden_layers + 1))
    layers = hf_config.vision_config.num_hidden_layers
    used = layer % (layers + 1)  # hidden_states[0] is the embeddings: layer k's output is index k
    return [f"model.vision_tower.encoder.layers.{i}" for i in range(used, layers)] + \
        ["model.vision_tower.post_layernorm"]


VISION = {
    "qwen2_5_vl": Vision("qwen2_5_vl", tower="model.visual", projector="model.visual.merger",
                         image_token="image_token_id", markers=("vision_start_token_id", "vision_end_token_id"),
                         positions="mrope"),
    "qwen2_vl": Vision("qwen2_vl", tower="model.visual", projector="model.visual.merger",
                       image_token="image_token_id", markers=("vision_start_token_id", "vision_end_token_id"),
                       positions="mrope"),
    "llava": Vision("llava", tower="model.vision_tower", projector="model.multi_modal_projector",
                    image_token="image_token_index", unused=_llava_unused,
                    seeded_init=False),  # LlavaPreTrainedModel._init_weights leaves CLIP's own init undone
}


def tower_shape(hf_config) -> dict:
    """The tower's dimensions the memory estimate reads: layers, hidden, MLP width, gated MLP, inputs per
    patch (3·t·p² pixel values) and patches per image token (Qwen2.5-VL merges 2x2 patches into one)."""
    v = hf_config.vision_config
    act = str(getattr(v, "hidden_act", "gelu"))
    width = int(getattr(v, "embed_dim", None) or v.hidden_size)  # Qwen2-VL: hidden_size is the merger's output
    mlp = getattr(v, "intermediate_size", None) or int(v.mlp_ratio * width)
    return {"layers": int(getattr(v, "depth", None) or v.num_hidden_layers), "hidden": width,
            "mlp": int(mlp), "glu": "silu" in act or "swiglu" in act,
            "patch_inputs": int(3 * getattr(v, "temporal_patch_size", 1) * v.patch_size ** 2),
            "patches_per_token": int(getattr(v, "spatial_merge_size", 1) ** 2)}


def find_vision(model_type: str | None) -> Vision | None:
    return VISION.get(model_type)


def is_vision_config(hf_config) -> bool:
    """An image-text-to-text model (a ``vision_config`` beside its text config)."""
    return getattr(hf_config, "vision_config", None) is not None


def image_token_id(vision: Vision, hf_config) -> int:
    return int(getattr(hf_config, vision.image_token))


def marker_ids(vision: Vision, hf_config) -> list[int]:
    return [int(getattr(hf_config, f)) for f in vision.markers if getattr(hf_config, f, None) is not None]


def frozen_prefixes(vision: Vision, hf_config, freeze_vision: bool) -> list[str]:
    """With ``freeze_vision`` the tower (the projector trains; the unused parameters are in it), else the
    unused parameters' modules."""
    if freeze_vision:
        return [vision.tower]
    return vision.unused(hf_config) if vision.unused else []


def is_frozen(name: str, vision: Vision, hf_config, freeze_vision: bool) -> bool:
    if freeze_vision and vision.is_tower(name):
        return True
    return any(_under(name, p) for p in (vision.unused(hf_config) if vision.unused else []))


def describe(config: dict) -> str:
    """One line for ``toolkit inspect`` from a config.json as written (a dict)."""
    text, tower = config.get("text_config") or {}, config.get("vision_config") or {}
    vision = find_vision(config.get("model_type"))
    blocks = tower.get("depth") or tower.get("num_hidden_layers")
    where = (f"tower {vision.tower} ({blocks} blocks, hidden {tower.get('hidden_size')}; frozen unless "
             f"model.freeze_vision=false), projector {vision.projector}, image token id "
             f"{config.get(vision.image_token)}") if vision else "no toolkit vision table: not trainable here"
    return (f"vision-language model {config.get('model_type')}: language model {text.get('model_type')} "
            f"({text.get('num_hidden_layers')} layers, hidden {text.get('hidden_size')}), {where}")

