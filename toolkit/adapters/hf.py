"""The HuggingFace model both backends start from, built without a whole-model host copy where the
layout shards it, and the AdamW parameter groups.

Weights come from one of two sources, the same for every backend, layout and DP size:

- ``model.init=random``: ``SeededWeights``. The model is cut into pieces (each decoder layer, the
  embedding, the final norm, the LM head); each piece's parameters are HF's own init of that piece
  alone (``_init_weights`` over its modules, in HF's order), drawn in fp32 with a generator seeded
  from (train.seed, piece name). A tensor's values therefore do not depend on which other tensors a
  rank builds, in which order, or in which dtype it keeps them: a ZeRO-3 rank, a megatron TP rank
  and a single-process reference all get the same weights, one piece at a time. (A tied embedding
  takes the embedding's init.)
- ``model.init=pretrained``: the checkpoint, read by slice through the converter's HF reader
  (``formats/hf.py``: safetensors, sharded with an index, truncation checks).

The model skeleton is ``families/meta.py``'s (parameters on the meta device, buffers real) and its
parameters materialized in the training dtype (ZeRO 0-2: the one full copy ZeRO 0-2 keep by
design), or under DeepSpeed's ``zero.Init`` (ZeRO-3: each rank holds its partition from the start;
see ``adapters/deepspeed/engine.py``).
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable

import torch

from toolkit.config import ConfigError
from toolkit.device import host_checkpoint
from toolkit.families.meta import auto_class
from toolkit.parallel import unit_seed
from toolkit.plan import Plan


def empty_model(hf_config) -> torch.nn.Module:
    """The HF causal LM with its parameters on the meta device (no memory) and real buffers."""
    from toolkit.families.meta import meta_model
    # eager for a capped or windowed model: transformers' default may refuse a request it cannot
    # honour (5.24: gemma2 with sdpa); ``finish`` switches it to the toolkit's attention
    choice = {"attn_implementation": "eager"} if caps_or_windows(hf_config) else {}
    model = meta_model(hf_config, dtype=torch.float32, **choice)
    model.config.use_cache = False
    return model


def materialize(module: torch.nn.Module, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
    """Replace meta parameters with uninitialized ones of ``dtype`` on ``device``, keeping tied
    parameters tied (a parameter registered in two modules stays one tensor)."""
    made: dict[int, torch.nn.Parameter] = {}
    for owner in module.modules():
        for name, param in list(owner._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in made:
                made[id(param)] = torch.nn.Parameter(torch.empty(param.shape, dtype=dtype, device=device),
                                                     requires_grad=param.requires_grad)
            owner._parameters[name] = made[id(param)]


def post_order(model: torch.nn.Module, prefix: str = "") -> list[tuple[str, torch.nn.Module]]:
    """(name, module) children first, as HF's ``initialize_weights`` visits them."""
    out = []
    for child_name, child in model.named_children():
        out += post_order(child, f"{prefix}.{child_name}" if prefix else child_name)
    out.append((prefix, model))
    return out


def init_units(model: torch.nn.Module) -> list[str]:
    """The model cut into the pieces its init is drawn in: each element of a module list (a
    decoder layer) and each other largest subtree holding parameters but no module list (the
    embedding, the final norm, the LM head). HF's init of a module may reach into its children
    (GPT-2 rescales ``c_proj`` from the block), never across these pieces."""
    units = []

    def visit(name: str, module: torch.nn.Module, in_list: bool) -> None:
        has_list = any(isinstance(m, torch.nn.ModuleList) for m in module.modules())
        if (in_list or not has_list) and any(True for _ in module.parameters()):
            units.append(name)
            return
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child, isinstance(module, torch.nn.ModuleList))
    visit("", model, False)
    covered = {id(p) for unit in units for p in model.get_submodule(unit).parameters()}
    for name, module in post_order(model):  # parameters held right beside a module list: their module
        if any(id(p) not in covered for p in module.parameters(recurse=False)):
            units.append(name)
    return units


class SeededWeights:
    """HF's init of the model, drawn piece by piece (``init_units``): each piece alone, in fp32,
    from a generator seeded with (seed, piece name), HF's ``_init_weights`` applied to its modules
    in HF's order. A parameter two pieces share (a tied embedding) belongs to the first.
    ``unit_tensors(unit)``: that piece's parameters by full name, freshly drawn."""

    def __init__(self, hf_config, seed: int):
        self.model = empty_model(hf_config)
        self.seed = seed
        self.units = init_units(self.model)
        self.unit_of: dict[str, str] = {}
        owner: dict[int, str] = {}
        for unit in self.units:
            for name, param in self.model.get_submodule(unit).named_parameters(prefix=unit):
                owner.setdefault(id(param), unit)
        for name, param in self.model.named_parameters():
            self.unit_of[name] = owner[id(param)]

    def owned(self, unit: str) -> list[str]:
        return [n for n, u in self.unit_of.items() if u == unit]

    def unit_tensors(self, unit: str) -> dict[str, torch.Tensor]:
        from transformers import initialization
        piece = copy.deepcopy(self.model.get_submodule(unit))  # meta parameters: nothing is copied
        materialize(piece, torch.float32)
        with torch.no_grad(), initialization.guard_torch_init_functions(), torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(unit_seed(self.seed, unit))  # the CPU's only: GPU streams untouched
            for _, module in post_order(piece):
                self.model._init_weights(module)
        tensors = dict(piece.named_parameters(prefix=unit, remove_duplicate=False))
        return {n: tensors[n].detach() for n in self.owned(unit)}


def seeded_into(model: torch.nn.Module, weights: SeededWeights, gather=None) -> None:
    """Fill ``model``'s parameters (materialized, any dtype; or ZeRO-3 partitions with ``gather``)
    from ``weights``, one piece at a time. ``gather(param)``: a context in which the parameter is
    whole and this rank's writes are kept, yielding whether this rank writes (ZeRO-3: rank 0)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for unit in weights.units:
            names = weights.owned(unit)
            tensors = None
            for name in names:
                with gather(params[name]) if gather else _writes() as writer:
                    if writer:
                        tensors = tensors if tensors is not None else weights.unit_tensors(unit)
                        params[name].copy_(tensors[name])


class _writes:
    def __enter__(self):
        return True

    def __exit__(self, *exc):
        return False


def build_model(plan: Plan, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                attention: Callable[[torch.nn.Module], None] | None = None) -> torch.nn.Module:
    """The whole HF model in ``dtype`` on ``device`` (one copy: ZeRO 0-2 on the rank's device,
    tests and references on the CPU); ``attention``: as ``finish`` takes it."""
    cfg = plan.config
    if cfg.model.init == "pretrained" and not reads_by_slice(plan):
        model = auto_class(plan.model.hf_config()).from_pretrained(
            model_dir(cfg.model.name_or_path), dtype=dtype, trust_remote_code=cfg.model.trust_remote_code)
        return finish(model.to(device), plan, attention)
    model = empty_model(plan.model.hf_config())
    materialize(model, dtype, device)
    if cfg.model.init == "pretrained":
        fill_from_checkpoint(model, hf_checkpoint(plan), plan)
    else:
        seeded_into(model, SeededWeights(model.config, cfg.train.seed))
    return finish(model, plan, attention)


def reads_by_slice(plan: Plan) -> bool:
    """Whether the toolkit knows this model's checkpoint names (a family table, ``toolkit/families``)
    and so reads a pretrained checkpoint by slice; other models load through transformers."""
    from toolkit.families import find_family
    return find_family(plan.model.model_type) is not None


def model_dir(name_or_path: str) -> str:
    path = Path(name_or_path)
    return str(path.parent if path.is_file() else path)


def finish(model: torch.nn.Module, plan: Plan,
           attention: Callable[[torch.nn.Module], None] | None = None) -> torch.nn.Module:
    """Checkpointing, no KV cache, and the attention: ``attention`` installs what a backend's split of
    the sequence needs (DeepSpeed's Ulysses: ``adapters/deepspeed/engine.py`` passes it), else the
    toolkit's document attention where rows carry documents or the model caps or windows it."""
    if plan.config.model.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if plan.config.backend == "deepspeed" and plan.config.zero.offload_activations:
            # the same layers checkpointed, their saved inputs kept on the host (the config refuses it otherwise)
            model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=host_checkpoint)
    model.config.use_cache = False
    set_experts_implementation(model, plan.config.model.experts_implementation)
    from toolkit.adapters import vlm
    if vlm.is_vlm(model):  # its tower frozen, document attention on its language model only
        vlm.freeze(model, plan.config.model.freeze_vision)
        vlm.use_text_document_attention(model)
        return model
    # rows carry document_ids, or the model caps or windows its attention: the toolkit's attention
    # applies them whatever transformers would choose (5.17 gives gemma2 sdpa, which drops the softcap)
    if attention is not None:  # it applies the same inside its own exchange
        attention(model)
    elif plan.config.data.packing_mode != "concat" or caps_or_windows(model.config):
        from toolkit.adapters.hf_attention import use_document_attention
        use_document_attention(model)
    return model


def set_experts_implementation(model: torch.nn.Module, choice: str) -> str | None:
    """``model.experts_implementation`` on an HF model: ``auto`` keeps transformers' own choice
    (``grouped_mm`` in transformers 5 where its check passes), ``eager`` / ``grouped_mm`` are set with
    transformers' ``set_experts_implementation``. The implementation the experts run (None: the model
    has no experts transformers can switch); a model class that cannot honour an explicit choice is
    refused with transformers' reason."""
    if experts_implementation(model) is None:  # no switchable experts: a dense model or custom MoE code
        if choice == "grouped_mm":  # the plan refuses it for dense models; custom experts have their own loop
            raise ConfigError(f"model.experts_implementation=grouped_mm: {type(model).__name__}'s experts are not "
                              "transformers' switchable experts (@use_experts_implementation); set "
                              "model.experts_implementation=auto")
        return None
    if choice != "auto":
        try:
            model.set_experts_implementation(choice)
        except (ValueError, ImportError) as exc:
            raise ConfigError(f"model.experts_implementation={choice}: {exc}; set model.experts_implementation="
                              "auto (transformers' choice)") from None
    return experts_implementation(model)


def experts_implementation(model: torch.nn.Module) -> str | None:
    """The experts implementation transformers runs for ``model`` (peft-wrapped or not); None for a model
    whose experts are not transformers' switchable ``@use_experts_implementation`` modules."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not hasattr(base, "_can_set_experts_implementation") or not base._can_set_experts_implementation():
        return None
    return base.config._experts_implementation


def caps_or_windows(hf_config) -> bool:
    """Whether the model caps attention logits or slides a window (by its family's table; for a
    model without one, by HF's config fields). transformers' attention implementations differ in
    whether they apply these, so such a model never runs on the one transformers picks."""
    from toolkit.families import find_family
    family = find_family(getattr(hf_config, "model_type", None))
    if family is None:
        return getattr(hf_config, "attn_logit_softcapping", None) is not None \
            or bool(getattr(hf_config, "sliding_window", None))
    return bool(family.attention_softcap and family.attention_softcap(hf_config) is not None) \
        or bool(family.sliding_windows(hf_config))


# --- pretrained weights, by element range ----------------------------------------------------------

def hf_checkpoint(plan: Plan):
    """The converter's reader of the model directory (``model.init=pretrained``)."""
    from toolkit.formats.errors import ConvertError
    from toolkit.formats.hf import HFSource
    path = Path(plan.config.model.name_or_path)
    try:
        return HFSource(path.parent if path.is_file() else path, plan.model.hf)
    except ConvertError as exc:
        raise ConfigError(f"model.init=pretrained: {exc}") from None


def checkpoint_pieces(model: torch.nn.Module, plan: Plan, source) -> dict[str, list]:
    """Module parameter name -> the checkpoint tensors composing it, in flattened order
    (``families.Piece``: a packed MoE parameter is several; any other parameter is itself). Strict:
    every parameter found, every checkpoint tensor used."""
    from toolkit.families import find_family, unpacked_layout
    shapes = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in model.named_parameters()}
    layout = unpacked_layout(find_family(plan.model.model_type), model.config, shapes)
    missing = sorted(set(layout) - set(source.infos))
    unexpected = sorted(set(source.infos) - set(layout))
    if missing or unexpected:
        raise ConfigError(f"model.name_or_path={plan.config.model.name_or_path!r}: the checkpoint does not match "
                          f"the {plan.model.model_type} model; missing {missing[:10]}, unexpected "
                          f"{ {k: tuple(source.infos[k].shape) for k in unexpected[:10]} } (is config.json the one "
                          "saved with these weights?)")
    pieces: dict[str, list] = {}
    for ckpt_name, piece in layout.items():
        pieces.setdefault(piece.module, []).append((ckpt_name, piece))
    return pieces


def read_elements(source, pieces: list, start: int, stop: int) -> torch.Tensor:
    """Elements ``[start, stop)`` of a module parameter, flattened, reading from the checkpoint only
    the rows that hold them."""
    parts = []
    for ckpt_name, piece in pieces:
        lo, hi = max(start, piece.start), min(stop, piece.start + piece.numel)
        if lo >= hi:
            continue
        row = max(1, piece.numel // piece.shape[0]) if piece.shape else 1
        a, b = lo - piece.start, hi - piece.start
        rows = source.slice_of(ckpt_name)[a // row:-(-b // row)]
        parts.append(rows.reshape(-1)[a - (a // row) * row:b - (a // row) * row])
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def page_returner(source):
    """A call that gives back the pages of ``source``'s memory-mapped shards and the heap's free
    pages (``formats/pages.py``). Called after each tensor, a load keeps one tensor's file pages
    resident, not every page it has read (safetensors maps a shard whole): on a ZeRO-3 rank that was
    its whole share of the files again, beside the partitions it filled."""
    from toolkit.formats.pages import SourceMaps, give_back
    maps = SourceMaps(source.path)
    return lambda: give_back(maps)


def fill_from_checkpoint(model: torch.nn.Module, source, plan: Plan) -> None:
    """Every (materialized) parameter from the checkpoint, one tensor at a time."""
    pieces, give_back = checkpoint_pieces(model, plan, source), page_returner(source)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.view(-1).copy_(read_elements(source, pieces[name], 0, param.numel()))
            give_back()


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only; biases and norm weights (1-D) are not decayed, as in Megatron and HF."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if len(getattr(p, "ds_shape", p.shape)) >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
