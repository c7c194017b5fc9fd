"""Model families: one module per HF ``model_type`` defining ``FAMILY`` (its weight table and layer
structure) and ``TINY`` (its tiny test config, ``tiny.py``); discovered, never listed.

Generic conversions over a family's weight table (pure tensor logic):
  ``hf_to_mcore``   HF state -> full mcore tensors (global layer numbers, padded vocab)
  ``mcore_to_hf``   the inverse
  ``shard``/``unshard``  full mcore tensors <-> TP rank r's tensors
  ``unpacked_layout``, ``unpack``/``pack``  transformers (>= 5) module parameters <-> checkpoint
                    tensors (MoE experts are one packed parameter in memory, one tensor each on disk)
"""
from __future__ import annotations

import importlib
import math
import pkgutil
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Mapping

import torch

from toolkit.families.base import Family, FamilyError, MappingReader, Packed, Reader, attention_dims, rope_parameters
from toolkit.layout import padded_vocab_size  # its one home; re-exported for the family tools

__all__ = ["Family", "FamilyError", "get_family", "supported", "hf_to_mcore", "mcore_to_hf", "shard",
           "unshard", "read_shard", "Reader", "MappingReader", "padded_vocab_size", "rope_parameters", "table",
           "find_family", "family_modules", "attention_dims", "Piece", "unpacked_layout", "unpack", "pack", "EXPERTS",
           "split_expert"]


@lru_cache(maxsize=1)
def family_modules() -> dict[str, object]:
    """model_type -> the module defining its ``FAMILY`` (and its tiny test config ``TINY``)."""
    found = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name in ("base", "tiny"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        family = getattr(module, "FAMILY", None)
        if isinstance(family, Family):
            found[family.model_type] = module
    return found


def _registry() -> dict[str, Family]:
    return {model_type: module.FAMILY for model_type, module in family_modules().items()}


def find_family(model_type: str | None) -> Family | None:
    """The family of ``model_type``, or None (the DeepSpeed path and HF/ZeRO conversions need none)."""
    return _registry().get(model_type) if model_type else None


def supported() -> list[str]:
    return sorted(_registry())


def get_family(model_type: str) -> Family:
    try:
        return _registry()[model_type]
    except KeyError:
        raise FamilyError(f"model_type={model_type!r} has no megatron family; supported: {supported()} "
                          "(add one as a small file in toolkit/families/, or use backend=deepspeed)") from None


def table(family: Family, hf_config, layers: Iterable[int] | None = None) -> dict[str, tuple]:
    """mcore name -> (entry, hf prefix) for the given global layers (default: all)."""
    layers = range(hf_config.num_hidden_layers) if layers is None else layers
    return {mp + e.mcore: (e, hp) for e, hp, mp in family.entries(hf_config, layers)}


def hf_to_mcore(family: Family, hf_config, hf_state: Mapping[str, torch.Tensor], padded_vocab: int,
                layers: Iterable[int] | None = None, names: Iterable[str] | None = None,
                strict: bool = True) -> dict[str, torch.Tensor]:
    """Full mcore tensors from HF tensors. ``names`` limits the output (a rank's share); ``hf_state``
    is read only for the keys those need. ``strict``: every HF key must be used exactly once."""
    dims = family.dims(hf_config, padded_vocab)
    entries = table(family, hf_config, layers)
    wanted = entries if names is None else {n: entries[n] for n in names}
    missing = [hp + n for e, hp in wanted.values() for n in e.hf_names() if hp + n not in hf_state]
    if missing:
        raise FamilyError(f"{family.model_type}: HF weights lack {len(missing)} tensors the table needs: "
                          f"{missing[:20]}")
    out = {}
    for name, (e, hp) in wanted.items():
        out[name] = e.to_mcore({n: hf_state[hp + n] for n in e.hf_names()}, dims)
    if strict:
        _check_all_used(family, hf_config, hf_state, entries, out)
    return out


def _check_all_used(family, hf_config, hf_state, entries, out) -> None:
    used = {hp + n for e, hp in entries.values() for n in e.hf_names()}
    unexpected = [k for k in hf_state.keys() if k not in used]
    if family.tied(hf_config) and "lm_head.weight" in unexpected:
        unexpected.remove("lm_head.weight")  # tied: the same tensor as the input embedding
    if unexpected:
        shapes = {k: tuple(hf_state[k].shape) for k in unexpected[:20]}
        raise FamilyError(f"{family.model_type}: {len(unexpected)} HF tensors are not in the weight table "
                          f"(the model has parts the family cannot convert): {shapes}")


def mcore_to_hf(family: Family, hf_config, mcore_state: Mapping[str, torch.Tensor],
                padded_vocab: int) -> dict[str, torch.Tensor]:
    """HF tensors from full mcore tensors of all layers; strict both ways (``_extra_state`` ignored).
    A tied model also gets ``lm_head.weight`` (as HF's own state dict has)."""
    dims = family.dims(hf_config, padded_vocab)
    entries = table(family, hf_config)
    given = {k for k in mcore_state if not k.endswith("._extra_state")}
    if family.tied(hf_config):
        given.discard("output_layer.weight")
    missing, unexpected = sorted(set(entries) - given), sorted(given - set(entries))
    if missing or unexpected:
        raise FamilyError(f"{family.model_type}: mcore state does not match the weight table; missing "
                          f"{missing[:20]}, unexpected { {k: tuple(mcore_state[k].shape) for k in unexpected[:20]} }")
    out = {}
    for name, (e, hp) in entries.items():
        out.update({hp + k: v for k, v in e.to_hf(mcore_state[name], dims).items()})
    if family.tied(hf_config):
        emb = next(hp + e.hf for n, (e, hp) in entries.items() if n == "embedding.word_embeddings.weight")
        out["lm_head.weight"] = out[emb]
    return out


def read_shard(family: Family, hf_config, name: str, hf_tensors, padded_vocab: int, tp: int,
               rank: int) -> torch.Tensor:
    """TP rank ``rank``'s tensor ``name`` (global layer numbers) read straight from HF tensors,
    touching only its slices. ``hf_tensors``: a Mapping, or a ``Reader`` (e.g. safetensors slices).
    Equal to ``shard(..., hf_to_mcore(...)[name], ...)``."""
    entry, prefix = table(family, hf_config, _layer_of(name))[name]
    reader = hf_tensors if isinstance(hf_tensors, Reader) else MappingReader(hf_tensors)
    return entry.read_shard(_Prefixed(reader, prefix), family.dims(hf_config, padded_vocab), tp, rank)


class _Prefixed(Reader):
    def __init__(self, reader: Reader, prefix: str):
        self.reader, self.prefix = reader, prefix

    def shape(self, name):
        return self.reader.shape(self.prefix + name)

    def dtype(self, name):
        return self.reader.dtype(self.prefix + name)

    def slice(self, name, dim=None, start=0, stop=None):
        return self.reader.slice(self.prefix + name, dim, start, stop)


def _layer_of(name: str) -> list[int]:
    return [int(name.split(".")[2])] if name.startswith("decoder.layers.") else []


EXPERTS = "mlp.experts.local_experts."
"""Routed experts' mcore parameters: ``decoder.layers.{i}.mlp.experts.local_experts.{e}.<tail>``."""


def split_expert(mcore_name: str) -> tuple[int, int, str] | None:
    """(layer, expert, tail) of a routed expert's mcore parameter name; None for any other name."""
    if not mcore_name.startswith("decoder.layers."):
        return None
    _, _, layer, rest = mcore_name.split(".", 3)
    if not rest.startswith(EXPERTS):
        return None
    expert, tail = rest[len(EXPERTS):].split(".", 1)
    return int(layer), int(expert), tail


def shard(family: Family, hf_config, name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """TP rank ``rank``'s part of the full mcore tensor ``name``."""
    return _entry(family, hf_config, name).shard(full, tp, rank)


def unshard(family: Family, hf_config, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The full mcore tensor ``name`` from its TP parts in rank order."""
    return _entry(family, hf_config, name).unshard(parts)


def _entry(family, hf_config, name):
    if name == "output_layer.weight":
        name = "embedding.word_embeddings.weight" if family.tied(hf_config) else name
    if name.startswith("decoder.layers."):
        layer = int(name.split(".")[2])
        return table(family, hf_config, [layer])[name][0]
    return table(family, hf_config, [])[name][0]


# --- transformers' packed module parameters <-> checkpoint tensors ----------------------------------

@dataclass(frozen=True)
class Piece:
    """Where a checkpoint tensor lies in a module parameter: elements ``[start, start + numel)`` of
    the flattened ``module`` tensor, viewed as ``shape``."""
    module: str
    start: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _packs(family: Family | None, hf_config) -> dict[str, tuple[Packed, str]]:
    if family is None or not family.packed:
        return {}
    prefixes = [family.hf_layer.format(i=i) for i in range(hf_config.num_hidden_layers)]
    return {hp + p.module: (p, hp) for hp in prefixes for p in family.packed}


def unpacked_layout(family: Family | None, hf_config, module_shapes: Mapping[str, tuple]) -> dict[str, Piece]:
    """Checkpoint name -> ``Piece`` for every tensor of a module state (names and shapes as a
    transformers model's ``state_dict`` has them), in module order, experts in order. Tensors that
    are not packed map to themselves; a state already in checkpoint names maps to itself.
    The parts of a packed parameter split its rows (dim 0 of an expert's slice) equally."""
    packs = _packs(family, hf_config)
    out = {}
    for name, shape in module_shapes.items():
        shape = tuple(shape)
        if name not in packs:
            out[name] = Piece(name, 0, shape)
            continue
        p, prefix = packs[name]
        experts, slab = (shape[0], shape[1:]) if p.per_expert else (1, shape)
        if p.per_expert and experts != family.num_experts(hf_config):
            raise FamilyError(f"{name} has shape {shape}: {experts} experts on dim 0, but the config has "
                              f"{family.num_experts(hf_config)}; the checkpoint and its config.json do not match")
        if slab[0] % len(p.parts):
            raise FamilyError(f"{name} has shape {shape}: {slab[0]} rows do not split into the parts {p.parts}; "
                              "the checkpoint and its config.json do not match")
        part_shape = (slab[0] // len(p.parts), *slab[1:])
        for e in range(experts):
            for j, part in enumerate(p.parts):
                start = (e * len(p.parts) + j) * math.prod(part_shape)
                out[prefix + part.format(e=e)] = Piece(name, start, part_shape)
    return out


def unpack(family: Family | None, hf_config, module_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint-named views of a module state (what ``save_pretrained`` writes)."""
    layout = unpacked_layout(family, hf_config, {k: tuple(v.shape) for k, v in module_state.items()})
    return {n: module_state[p.module].reshape(-1)[p.start:p.start + p.numel].view(p.shape) for n, p in layout.items()}


def pack(family: Family | None, hf_config, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A module state (what ``load_state_dict`` of a transformers model takes) from checkpoint-named
    tensors; the inverse of ``unpack``. Names of no packed parameter pass through."""
    first_part = {}  # the checkpoint name where each packed parameter goes, to keep the order
    for module, (p, prefix) in _packs(family, hf_config).items():
        experts = range(family.num_experts(hf_config)) if p.per_expert else [None]
        names = [[prefix + part.format(e=e) for part in p.parts] for e in experts]
        if all(n in state for group in names for n in group):  # else already packed, or not in this state
            first_part[names[0][0]] = (module, p, names)
    out, used = {}, {n for _, _, names in first_part.values() for group in names for n in group}
    for name, tensor in state.items():
        if name in first_part:
            module, p, names = first_part[name]
            slabs = [torch.cat([state[n] for n in group]) for group in names]
            out[module] = torch.stack(slabs) if p.per_expert else slabs[0]
        elif name not in used:
            out[name] = tensor
    return out
