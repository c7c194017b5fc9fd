"""Where each parameter of a native DeepSpeed ZeRO 1/2/3 checkpoint lies, without torch.

``ZeroIndex`` holds the layout knowledge (documented in ``zero.py``): which rank's flat fp32 group
holds which element range of which parameter, padding, frozen parameters, tied aliases. It works on
whatever its ``load`` function returns for a ``.pt`` file, as long as tensors answer ``shape``,
``numel()`` and (for a step count) ``item()``: ``ZeroSource`` passes ``safeload.safe_load``
(memory-mapped torch tensors), the direct ZeRO -> HF copy passes ``torchzip.load`` (records of
where the bytes lie, no torch import). One index, two kinds of tensors, the same names and order.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from toolkit.formats.errors import ConvertError
from toolkit.formats.zero_autoep import AUTOEP_EXPERTS, AutoEPLayout, hf_name
from toolkit.storage import UnsafeTag, read_tag

OPTIM_RE = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def find_tag_dir(path: Path) -> Path | None:
    """The ``global_stepN`` folder under a toolkit checkpoint, its ``engine/``, an HF Trainer
    ``checkpoint-N/`` or the tag folder itself; None when there is none."""
    path = Path(path)
    for cand in (path, path / "engine"):
        if not cand.is_dir():
            continue
        if any(OPTIM_RE.match(p.name) for p in cand.iterdir()) or is_universal(cand):
            return cand
        for latest in ("latest", "latest_universal"):
            if (cand / latest).is_file():
                try:
                    tag = cand / read_tag(cand / latest)
                except UnsafeTag as exc:
                    raise ConvertError(str(exc)) from None
                if tag.is_dir():
                    return tag
                raise ConvertError(f"{cand / latest} names tag {tag.name!r}, but {tag} is missing; the checkpoint "
                                   "is incomplete")
    return None


def is_universal(tag_dir: Path) -> bool:
    """DeepSpeed's universal layout (``zero/<param>/fp32.pt``), not the native per-rank partitions."""
    return (Path(tag_dir) / "zero" / "optimizer_state.pt").is_file()


@dataclass
class Frag:
    """Where a parameter's elements lie: rank, group, start and length in that rank's flat group;
    or, for a frozen parameter (no optimizer state), in ``frozen``, a tensor of a model-states
    file whose flattened elements ``[start, start + length)`` they are."""
    rank: int
    group: int
    start: int
    length: int
    frozen: object | None = None


def spans(frags: list[Frag], start: int, stop: int):
    """``(frag, first, count)``: elements ``[first, first + count)`` of each fragment's holder that
    make elements ``[start, stop)`` of the flattened tensor (stage 3's tail padding lies past the
    tensor's numel, so ``stop = numel`` leaves it out)."""
    pos = 0
    for f in frags:
        lo, hi = max(start, pos), min(stop, pos + f.length)
        if lo < hi:
            yield f, f.start + lo - pos, hi - lo
        pos += f.length


def sub_frags(frags: list[Frag], start: int, stop: int) -> list[Frag]:
    """The fragments of elements ``[start, stop)`` of a tensor laid out as ``frags``."""
    return [dataclasses.replace(f, start=first, length=n) for f, first, n in spans(frags, start, stop)]


class ZeroIndex:
    """Module parameter name -> shape and fragments, in the order the checkpoint lists them (each
    group's ``param_shapes``, then frozen parameters, then tied aliases the stream keeps)."""

    def __init__(self, tag_dir: Path, load: Callable[[Path], dict], tied: bool):
        self.path = tag_dir
        self.files = optim_files(tag_dir)
        self.opt = [load(f)["optimizer_state_dict"] for f in self.files]
        first = self.opt[0]
        self.stage = int(first["zero_stage"])
        self.dp = len(self.files)
        counts = first["partition_count"]
        if max(counts if isinstance(counts, list) else [counts]) != self.dp:
            raise ConvertError(f"{tag_dir}: optimizer states say partition_count={counts}, but {self.dp} rank files "
                               "are present; a rank's file is missing")
        model = load(self._model_file())
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.frags: dict[str, list[Frag]] = {}
        self.frozen: set[str] = set()
        """Parameters DeepSpeed saved as frozen (no optimizer state)."""
        self.autoep = AutoEPLayout.of(model)
        """A ``zero.ep`` run's expert parallelism (DeepSpeed's AutoEP), or None."""
        if self.autoep and self.dp % self.autoep.ep:
            raise ConvertError(f"{tag_dir}: AutoEP ep={self.autoep.ep} does not divide the {self.dp} rank files")
        (self._index_stage3 if self.stage == 3 else self._index_stage12)(model["param_shapes"])
        self._index_frozen(model, load)
        self._add_shared(model.get("shared_params") or {}, tied)
        if self.autoep:
            self._as_transformers()
        self.hparams = _hparams(self.groups_state(0))
        self.step = _optimizer_step(self.groups_state(0), model.get("global_steps", 0))

    def _model_file(self) -> Path:
        name = "zero_pp_rank_0_mp_rank_00_model_states.pt" if self.stage == 3 else "mp_rank_00_model_states.pt"
        return self.path / name

    def groups_state(self, rank: int) -> dict:
        opt = self.opt[rank]
        return opt["optimizer_state_dict"] if self.stage == 3 else opt["base_optimizer_state"]

    def holder(self, frag: Frag, state: str = "param"):
        """The tensor a fragment's elements lie in: rank ``frag.rank``'s flat ``[P]`` vector of
        group ``frag.group`` (fp32 weights or an Adam moment), or a frozen parameter's tensor."""
        if frag.frozen is not None:
            return frag.frozen
        if state == "param":
            key = "fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"
            return self.opt[frag.rank][key][frag.group]
        return self.groups_state(frag.rank)["state"][frag.group][state]

    # --- name -> fragments ------------------------------------------------------------------------

    def _index_stage12(self, shapes: list[dict]) -> None:
        paddings = self.opt[0].get("param_alignment_paddings")
        for g, group in enumerate(shapes):
            part = self.opt[0]["single_partition_of_fp32_groups"][g].numel()
            ranks = self._partition_ranks(group)
            offset = 0
            for i, (name, shape) in enumerate(group.items()):
                numel = math.prod(shape)
                frags = [[Frag(rs[f.rank], f.group, f.start, f.length) for f in self._split_range(g, offset, numel, part)]
                         for rs in ranks]
                self._add(name, _whole_shape(shape, len(ranks)), [f for fs in frags for f in fs])
                offset += numel + (paddings[g][i] if paddings else 0)
            if offset > part * len(ranks[0]):
                raise ConvertError(f"{self.path}: group {g} needs {offset} elements, the partitions hold "
                                   f"{part * len(ranks[0])}; param_shapes do not match the optimizer states")

    def _partition_ranks(self, group: dict) -> list[list[int]]:
        """The ranks whose files hold a group's partitions, in partition order: all of them for a dense
        group; for an AutoEP expert group one list per EP rank (its experts, in expert order), each its
        expert-data-parallel ranks (the group's parameters are then the EP ranks' pieces concatenated)."""
        if not (self.autoep and group and all(self.autoep.is_expert(n) for n in group)):
            return [list(range(self.dp))]
        ep = self.autoep.ep
        return [[self.autoep.rank(e, r) for r in range(self.dp // ep)] for e in range(ep)]

    @staticmethod
    def _split_range(g: int, offset: int, numel: int, part: int) -> list[Frag]:
        """Stage 1/2: the flat range ``[offset, offset + numel)`` cut at partition boundaries."""
        frags, pos, end = [], offset, offset + numel
        while pos < end:
            rank, start = divmod(pos, part)
            length = min(end - pos, part - start)
            frags.append(Frag(rank, g, start, length))
            pos += length
        return frags

    def _index_stage3(self, shapes: list[dict]) -> None:
        """Each param's chunk lies at the same offset in every rank's flat group (of its partition ranks:
        an AutoEP expert's, ``_partition_ranks``; each EP rank's pieces end where its experts end)."""
        for g, group in enumerate(shapes):
            ranks = self._partition_ranks(group)
            offset = 0
            for name, shape in group.items():
                numel = math.prod(shape)
                chunk = math.ceil(numel / len(ranks[0]))
                frags = [Frag(r, g, offset, chunk) for rs in ranks for r in rs]
                if len(ranks) > 1:  # each EP rank's tail padding left out: their pieces follow each other
                    for k in range(len(ranks[0]) - 1, len(frags), len(ranks[0])):
                        frags[k] = dataclasses.replace(frags[k], length=numel - chunk * (len(ranks[0]) - 1))
                self._add(name, _whole_shape(shape, len(ranks)), frags)
                offset += chunk
            have = self.opt[0]["fp32_flat_groups"][g].numel()
            if offset != have:
                raise ConvertError(f"{self.path}: group {g} of param_shapes needs {offset} elements per rank, the "
                                   f"optimizer states hold {have}; model and optimizer files do not match")

    def _index_frozen(self, model: dict, load) -> None:
        """Parameters with ``requires_grad=False`` (a LoRA base, frozen embeddings): DeepSpeed keeps
        them out of the optimizer, in the model-states files: whole at stage 1/2, at stage 3 each
        rank's flat partition (``ceil(numel / dp)``, the last one padded) in its own file."""
        shapes = model.get("frozen_param_shapes") or {}
        if self.stage < 3:  # at stage 1 DeepSpeed does not record them: any module parameter the
            self._index_unrecorded_frozen(model, shapes)  # optimizer does not hold is one
        if not shapes:
            return
        models = [model]
        if self.stage == 3:
            files = [self.path / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(self.dp)]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise ConvertError(f"{self.path}: {missing} missing: they hold the frozen parameters' partitions; "
                                   "the checkpoint is incomplete")
            models += [load(f) for f in files[1:]]
        for name, shape in shapes.items():
            parts = [m["frozen_param_fragments"][name] for m in models]
            self._add(name, shape, [Frag(r, -1, 0, p.numel(), frozen=p) for r, p in enumerate(parts)])
        self.frozen |= set(shapes)

    def _index_unrecorded_frozen(self, model: dict, recorded: dict) -> None:
        """Stage 1/2 save the whole module state dict beside the optimizer's partitions; its
        parameters that neither the optimizer nor ``frozen_param_shapes`` holds were frozen."""
        buffers = set(model.get("buffer_names") or ())
        aliases = set(model.get("shared_params") or {}) | (self.autoep.aliases() if self.autoep else set())
        for name, tensor in (model.get("module") or {}).items():
            if name in self.shapes or name in recorded or name in buffers or name in aliases:
                continue
            self._add(name, tuple(tensor.shape), [Frag(0, -1, 0, tensor.numel(), frozen=tensor)])
            self.frozen.add(name)

    def _add(self, name: str, shape, frags: list[Frag]) -> None:
        self.shapes[name] = tuple(shape)
        self.frags[name] = frags

    def _add_shared(self, shared: dict, tied: bool) -> None:
        """DeepSpeed lists a tied weight once, with ``shared_params[alias] = owner``; the canonical
        stream drops the tied LM head (``lm_head.weight``, under peft's prefix in a LoRA checkpoint)
        when the config ties embeddings, else serves the owner's data. A LoRA checkpoint leaves the
        frozen base out (``exclude_frozen_parameters``) but still lists its ties: an alias of a
        parameter the checkpoint does not hold is left out with it."""
        for alias, owner in shared.items():
            if (tied and alias in TIED_HEADS) or owner not in self.shapes:
                continue
            self.shapes[alias], self.frags[alias] = self.shapes[owner], self.frags[owner]
        if tied:
            for head in TIED_HEADS:
                self.shapes.pop(head, None)
                self.frags.pop(head, None)


    def _as_transformers(self) -> None:
        """An AutoEP checkpoint's parameters under transformers' module names and shapes
        (``zero_autoep.py``'s table): each block's ``w1``/``w3`` interleaved per expert into ``gate_up_proj``,
        ``w2`` as ``down_proj``, the router and shared expert renamed; the order kept."""
        shapes, frags = {}, {}
        for name, shape in self.shapes.items():
            block, _, part = name.rpartition(".experts.")
            if not self.autoep.is_expert(name):
                hf = hf_name(name, self.autoep.blocks)
                shapes[hf], frags[hf] = shape, self.frags[name]
                continue
            for fused, parts in AUTOEP_EXPERTS.items():
                if part == parts[0]:
                    fused_name = f"{block}.experts.{fused}"
                    pieces = [(self.shapes[f"{block}.experts.{p}"], self.frags[f"{block}.experts.{p}"]) for p in parts]
                    shapes[fused_name] = (shape[0], sum(s[1] for s, _ in pieces), *shape[2:])
                    frags[fused_name] = _per_expert_concat(pieces, shape[0])
        self.shapes, self.frags = shapes, frags


def _whole_shape(shape, pieces: int) -> tuple[int, ...]:
    """A parameter's shape when ``pieces`` EP ranks' shards of it are concatenated on dim 0."""
    return (shape[0] * pieces, *shape[1:]) if pieces > 1 else tuple(shape)


def _per_expert_concat(pieces: list[tuple[tuple, list[Frag]]], experts: int) -> list[Frag]:
    """The fragments of ``cat(parts, dim=1)`` of ``[E, rows_i, ...]`` parts: per expert, each part's slab."""
    out = []
    for e in range(experts):
        for shape, frags in pieces:
            slab = math.prod(shape[1:])
            out += sub_frags(frags, e * slab, (e + 1) * slab)
    return out


TIED_HEADS = ("lm_head.weight", "base_model.model.lm_head.weight")
"""The output embedding's name in a transformers module and in the peft-wrapped one (a LoRA run's;
``lora.peft.PEFT_PREFIX``, not imported: this module runs without torch)."""


def optim_files(tag_dir: Path) -> list[Path]:
    """Every DP rank's optimizer-states file, in rank order (refused when one is missing)."""
    found = {}
    for p in tag_dir.iterdir():
        m = OPTIM_RE.match(p.name)
        if m:
            found[int(m.group(1))] = p
    if not found:
        raise ConvertError(f"{tag_dir}: no *_optim_states.pt files; not a DeepSpeed ZeRO checkpoint")
    missing = sorted(set(range(max(found) + 1)) - set(found))
    if missing:
        raise ConvertError(f"{tag_dir}: optimizer states of DP rank(s) {missing} are missing "
                           f"(zero_pp_rank_{missing[0]}_mp_rank_00_optim_states.pt); the checkpoint is incomplete")
    return [found[r] for r in sorted(found)]


def _optimizer_step(groups_state: dict, default: int) -> int:
    """Adam's step count (skipped fp16 steps do not count), else DeepSpeed's global step."""
    step = (groups_state.get("state") or {}).get(0, {}).get("step", default)
    return int(step.item() if hasattr(step, "item") else step)


def _hparams(groups_state: dict) -> dict:
    groups = groups_state.get("param_groups") or [{}]
    return {k: groups[0][k] for k in ("lr", "betas", "eps", "weight_decay") if k in groups[0]}
