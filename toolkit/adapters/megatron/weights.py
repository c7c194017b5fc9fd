"""HF weights into this rank's megatron chunks: every parameter exactly once, each TP rank reading
only its slices (through the family's weight table), plus what the table cannot say (HF's RoPE
frequencies, the embedding's ``padding_idx``)."""
from __future__ import annotations

import torch

from toolkit.adapters.megatron import grid
from toolkit.families.base import Reader
from toolkit.layout import Layout
from toolkit.plan import Plan


def hf_weights(plan: Plan, hf_config) -> Reader:
    """HF tensors by checkpoint name, read by slice: the model directory (``model.init=pretrained``)
    or the seeded init (``adapters/hf.py``), generated one module at a time. No rank builds the
    whole HF model."""
    if plan.config.model.init == "pretrained":
        return HFSliceReader(plan)
    return SeededReader(hf_config, plan.config.train.seed)


class SeededReader(Reader):
    """``adapters.hf.SeededWeights`` by checkpoint name (a packed MoE parameter's checkpoint
    tensors are its slices): a piece (a decoder layer, the embedding...) is drawn when first asked
    for and kept until another is."""

    def __init__(self, hf_config, seed: int):
        from toolkit.adapters.hf import SeededWeights
        from toolkit.families import find_family, unpacked_layout
        self.weights = SeededWeights(hf_config, seed)
        shapes = {n: tuple(p.shape) for n, p in self.weights.model.named_parameters()}
        self.unpacked = unpacked_layout(find_family(hf_config.model_type), hf_config, shapes)
        self._unit: tuple[str, dict] | None = None

    def keys(self):
        return self.unpacked.keys()

    def shape(self, name):
        return tuple(self.unpacked[name].shape)

    def dtype(self, name):
        return torch.float32

    def slice(self, name, dim=None, start=0, stop=None):
        piece = self.unpacked[name]
        unit = self.weights.unit_of[piece.module]
        if self._unit is None or self._unit[0] != unit:
            self._unit = (unit, self.weights.unit_tensors(unit))
        whole = self._unit[1][piece.module].reshape(-1)[piece.start:piece.start + piece.numel].view(piece.shape)
        if dim is None:
            return whole
        return whole[start:stop] if dim == 0 else whole[:, start:stop]


class HFSliceReader(Reader):
    """An HF ``save_pretrained`` directory through the converter's reader (``adapters.hf.hf_checkpoint``:
    safetensors, sharded with an index, truncation checks), read by slice: a TP rank reads only
    its part of each tensor."""

    def __init__(self, plan: Plan):
        from toolkit.adapters.hf import hf_checkpoint, page_returner
        self.source = hf_checkpoint(plan)
        self._give_back = page_returner(self.source)

    def keys(self):
        return self.source.infos.keys()

    def shape(self, name):
        return tuple(self.source.infos[name].shape)

    def dtype(self, name):
        return self.source.infos[name].dtype

    def slice(self, name, dim=None, start=0, stop=None):
        self._give_back()  # the previous slice's file pages (its tensor, if still in use, re-reads them)
        part = self.source.slice_of(name)
        if dim is None:
            return part[:]
        return part[start:stop] if dim == 0 else part[:, start:stop]


def checkpoint_names(family, hf_config, state):
    """HF tensors under their checkpoint names (MoE experts one tensor each, as ``save_pretrained``
    writes them), from a transformers module state; a lazy reader is passed through."""
    from toolkit.families import unpack
    return state if isinstance(state, Reader) else unpack(family, hf_config, state)


def global_name(name: str, offset: int, expert_offset: int = 0) -> str:
    """A chunk's parameter name with global layer (and expert) numbers."""
    from toolkit.families import EXPERTS, split_expert
    if not name.startswith("decoder.layers."):
        return name
    expert = split_expert(name)
    if expert is not None:
        layer, e, tail = expert
        return f"decoder.layers.{layer + offset}.{EXPERTS}{e + expert_offset}.{tail}"
    _, _, i, rest = name.split(".", 3)
    return f"decoder.layers.{int(i) + offset}.{rest}"


def expert_offset(chunk, ep: int) -> int:
    """Global number of this rank's first routed expert (the ``ep`` expert-parallel ranks hold blocks)."""
    if not getattr(chunk.config, "num_moe_experts", None):
        return 0
    per_rank = chunk.config.num_moe_experts // ep
    return grid.ep_rank() * per_rank


def is_expert(name: str) -> bool:
    from toolkit.families import split_expert
    return split_expert(name) is not None


def local_params(chunk) -> dict[str, torch.Tensor]:
    """The chunk's base tensors by local name (LoRA adapters, ``lora.py``, are not the HF model's)."""
    from toolkit.adapters.megatron.lora import is_adapter_name
    return {n: t for n, t in chunk.state_dict(keep_vars=True).items()
            if not n.endswith("_extra_state") and not is_adapter_name(n)}


def layer_offset(chunk) -> int:
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    return get_transformer_layer_offset(chunk.config, vp_stage=getattr(chunk, "vp_stage", None))


def release_storage(chunk) -> None:
    """Each parameter's storage traded for a placeholder of its shape (one zero, broadcast), until
    the loader fills it. megatron's DDP moves every trainable parameter into its contiguous buffer
    (a copy, then the parameter is a view of it): loaded before, the shard lived twice at that point,
    the parameters and the buffer (measured, TP=2: the peak 693 MB above the ready rank's resident
    memory, a 375M model). Loaded after, into the buffer's views, it lives once."""
    for param in chunk.parameters():
        one = torch.zeros(1, dtype=param.dtype, device=param.device)
        param.data = torch.empty(0, dtype=param.dtype, device=param.device).set_(
            one.untyped_storage(), 0, param.shape, (0,) * param.dim())  # not a view: DDP asserts _base is None


def _with_storage(param: torch.Tensor) -> torch.Tensor:
    """``param`` with storage of its own (a frozen one, which DDP leaves out of its buffer, may
    still hold ``release_storage``'s placeholder)."""
    if param.untyped_storage().nbytes() < param.numel() * param.element_size():
        param.data = torch.empty(param.shape, dtype=param.dtype, device=param.device)
    return param


def load_hf_into_chunk(chunk, family, hf_config, hf_state, lay: Layout, tp_rank: int) -> None:
    """Copy this rank's slices (at ``lay``'s tp, ep and padded vocabulary) of the HF tensors into
    ``chunk``; every parameter exactly once, reading only those slices (``hf_state``: a state dict, or
    a ``SafetensorsReader``)."""
    padded_vocab, tp = lay.padded_vocab, lay.tp
    from toolkit.families import MappingReader, Reader, read_shard, table
    offset, tied = layer_offset(chunk), family.tied(hf_config)
    local = local_params(chunk)
    source = {n: global_name(n, offset, expert_offset(chunk, lay.ep)) for n in local}
    if tied:  # a last pipeline stage holds its own copy of the tied embedding as output_layer
        source = {n: "embedding.word_embeddings.weight" if g == "output_layer.weight" else g for n, g in source.items()}
    known = table(family, hf_config)
    unknown = sorted(g for g in source.values() if g not in known)
    if unknown:
        raise RuntimeError(f"{family.model_type}: megatron parameters missing from the weight table: {unknown}")
    reader = hf_state if isinstance(hf_state, Reader) else MappingReader(hf_state)
    with torch.no_grad():
        for name, param in local.items():  # one slice at a time: memory bounded by the largest
            part = read_shard(family, hf_config, source[name], reader, padded_vocab, tp, tp_rank)
            if part.shape != param.shape:
                raise RuntimeError(f"{name}: converted slice has shape {tuple(part.shape)}, the model "
                                   f"expects {tuple(param.shape)}")
            _with_storage(param).copy_(part)
    _copy_rope(chunk, family, hf_config)
    _padding_idx_without_grad(chunk, family.padding_idx(hf_config), tp_rank)


def _padding_idx_without_grad(chunk, pad: int | None, tp_rank: int) -> None:
    """HF's ``nn.Embedding(padding_idx=pad)``: the lookup of ``pad`` sends no gradient to its row
    (the output layer still does when embeddings are tied). Megatron's embedding has no such
    option, so the looked-up vectors at ``pad`` positions are detached."""
    emb = getattr(getattr(chunk, "embedding", None), "word_embeddings", None)
    if pad is None or emb is None:
        return

    def hook(module, args, output):
        at_pad = args[0] == pad  # [batch, seq]
        if output.shape[:2] != at_pad.shape:  # sequence parallel: [seq / tp, batch, h], this TP rank's slice
            local = output.shape[0]
            start = tp_rank * local
            at_pad = at_pad.t()[start:start + local]
        return torch.where(at_pad.unsqueeze(-1), output.detach(), output)

    emb.register_forward_hook(hook)


def _copy_rope(chunk, family, hf_config) -> None:
    """megatron's own RoPE (``megatron.attention=local``) with HF's frequencies: exact by construction."""
    rope = getattr(chunk, "rotary_pos_emb", None)
    if rope is None or family.position_embedding != "rope":
        return
    inv_freq = rope_inv_freq(hf_config, rope.inv_freq.numel() * 2)
    rope.inv_freq = inv_freq.to(rope.inv_freq.device, rope.inv_freq.dtype)


def rope_inv_freq(hf_config, dim: int) -> torch.Tensor:
    """HF's own RoPE frequencies ``[dim / 2]`` (fp32, on the CPU) for a rotary dimension ``dim``:
    default, linear and llama3 scaling alike."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from toolkit.families import rope_parameters
    params = rope_parameters(hf_config)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        return 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    assert scaling == 1.0, f"rope type {rope_type} scales attention by {scaling}"
    return inv_freq


def check_hf_keys(family, hf_config, hf_state) -> None:
    """Strictness on the whole HF checkpoint without reading tensors: every key is in the table."""
    from toolkit.families import table
    from toolkit.families.base import FamilyError
    used = {hp + n for e, hp in table(family, hf_config).values() for n in e.hf_names()}
    keys = set(hf_state.keys())
    missing, unexpected = sorted(used - keys), sorted(keys - used - ({"lm_head.weight"} if family.tied(hf_config) else set()))
    if missing or unexpected:
        shape = hf_state.shape if isinstance(hf_state, Reader) else (lambda k: tuple(hf_state[k].shape))
        raise FamilyError(f"{family.model_type}: HF weights do not match the table; missing {missing[:20]}, "
                          f"unexpected { {k: shape(k) for k in unexpected[:20]} }")
