"""DeepSpeed ZeRO checkpoints: read stage 1/2/3 at any DP size, write DeepSpeed's universal layout.

Native layout read here (``TAG = global_stepN``), per DP rank ``r``:
  ``TAG/[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` ``optimizer_state_dict``:
    stage 1/2: ``single_partition_of_fp32_groups[g]`` is rank r's equal slice ``[P]`` of group g's
      flat fp32 vector ``[sum of numels (+ param_alignment_paddings), padded to dp * P]``; params
      lie back to back in ``param_shapes[g]`` order. ``base_optimizer_state.state[g]`` holds
      ``exp_avg`` / ``exp_avg_sq`` with the same layout, and ``step``.
    stage 3: ``fp32_flat_groups[g]`` is rank r's ``[sum over params of ceil(numel / dp)]``: each
      param contributes its own r-th ``ceil(numel / dp)`` chunk (the last rank's zero-padded);
      ``optimizer_state_dict.state[g]`` holds the moments with that layout.
  ``TAG/mp_rank_00_model_states.pt`` (stage 1/2) or ``TAG/zero_pp_rank_0_mp_rank_00_model_states.pt``
    (stage 3): ``param_shapes`` (one ordered dict per group), ``shared_params``, ``global_steps``.

Universal layout (written here, and read back): ``TAG/zero/<HF name>/{fp32,exp_avg,exp_avg_sq}.pt``
each ``{"param": full tensor}``, ``step.pt``, plus ``zero/optimizer_state.pt``; DeepSpeed loads it at
any DP size and stage with ``"checkpoint": {"load_universal": true}``.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from toolkit.convert.canonical import Source, TensorInfo, hf_config_object
from toolkit.convert.errors import ConvertError
from toolkit.convert.pages import FileMaps
from toolkit.convert.safeload import safe_load

OPTIM_RE = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def find_tag_dir(path: Path) -> Path | None:
    """The ``global_stepN`` folder under a toolkit checkpoint, its ``engine/``, an HF Trainer
    ``checkpoint-N/`` or the tag folder itself; None when there is none."""
    path = Path(path)
    for cand in (path, path / "engine"):
        if not cand.is_dir():
            continue
        if any(OPTIM_RE.match(p.name) for p in cand.iterdir()) or (cand / "zero" / "optimizer_state.pt").is_file():
            return cand
        for latest in ("latest", "latest_universal"):
            if (cand / latest).is_file():
                tag = cand / (cand / latest).read_text().strip()
                if tag.is_dir():
                    return tag
                raise ConvertError(f"{cand / latest} names tag {tag.name!r}, but {tag} is missing; the checkpoint "
                                   "is incomplete")
    return None


@dataclass
class _Frag:
    """Where a parameter's elements lie: rank, group, start and length in that rank's flat group;
    or, for a frozen parameter (no optimizer state), in ``frozen``, its flat data in a model-states file."""
    rank: int
    group: int
    start: int
    length: int
    frozen: torch.Tensor | None = None


class ZeroSource(Source):
    """A native DeepSpeed ZeRO 1/2/3 checkpoint; tensors are gathered from memory-mapped partitions."""

    def __init__(self, tag_dir: Path, hf_config: dict, **kw):
        super().__init__(path=tag_dir, format="zero", hf_config=hf_config, **kw)
        self.frozen: set[str] = set()
        """Parameters DeepSpeed saved as frozen (no optimizer state)."""
        self.files = self._optim_files(tag_dir)
        self._opt = [safe_load(f)["optimizer_state_dict"] for f in self.files]
        first = self._opt[0]
        self.stage = int(first["zero_stage"])
        self.dp = len(self.files)
        counts = first["partition_count"]
        if max(counts if isinstance(counts, list) else [counts]) != self.dp:
            raise ConvertError(f"{tag_dir}: optimizer states say partition_count={counts}, but {self.dp} rank files "
                               "are present; a rank's file is missing")
        model = safe_load(self._model_file(tag_dir))
        self.has_optimizer = True
        self.layout = {"dp": self.dp, "tp": 1, "pp": 1, "zero_stage": self.stage}
        self._frags: dict[str, list[_Frag]] = {}
        shapes = model["param_shapes"]
        (self._index_stage3 if self.stage == 3 else self._index_stage12)(shapes)
        self._index_frozen(tag_dir, model)
        self._add_shared(model.get("shared_params") or {})
        self._unpack_modules()
        self.maps = FileMaps()  # after every file is mapped: they live as long as this reader
        self.optimizer_hparams = _hparams(self._groups_state(0))
        self.step = _optimizer_step(self._groups_state(0), model.get("global_steps", 0))

    # --- files -------------------------------------------------------------------------------------

    @staticmethod
    def _optim_files(tag_dir: Path) -> list[Path]:
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

    def _model_file(self, tag_dir: Path) -> Path:
        name = "zero_pp_rank_0_mp_rank_00_model_states.pt" if self.stage == 3 else "mp_rank_00_model_states.pt"
        return tag_dir / name

    def _groups_state(self, rank: int) -> dict:
        opt = self._opt[rank]
        return opt["optimizer_state_dict"] if self.stage == 3 else opt["base_optimizer_state"]

    # --- index: name -> fragments ----------------------------------------------------------------

    def _index_stage12(self, shapes: list[dict]) -> None:
        paddings = self._opt[0].get("param_alignment_paddings")
        for g, group in enumerate(shapes):
            part = self._opt[0]["single_partition_of_fp32_groups"][g].numel()
            offset = 0
            for i, (name, shape) in enumerate(group.items()):
                numel = math.prod(shape)
                self._add(name, shape, self._split_range(g, offset, numel, part))
                offset += numel + (paddings[g][i] if paddings else 0)
            if offset > part * self.dp:
                raise ConvertError(f"{self.path}: group {g} needs {offset} elements, the partitions hold "
                                   f"{part * self.dp}; param_shapes do not match the optimizer states")

    def _split_range(self, g: int, offset: int, numel: int, part: int) -> list[_Frag]:
        """Stage 1/2: the flat range ``[offset, offset + numel)`` cut at partition boundaries."""
        frags, pos, end = [], offset, offset + numel
        while pos < end:
            rank, start = divmod(pos, part)
            length = min(end - pos, part - start)
            frags.append(_Frag(rank, g, start, length))
            pos += length
        return frags

    def _index_stage3(self, shapes: list[dict]) -> None:
        """Each param's chunk lies at the same offset in every rank's flat group."""
        for g, group in enumerate(shapes):
            offset = 0
            for name, shape in group.items():
                numel = math.prod(shape)
                chunk = math.ceil(numel / self.dp)
                self._add(name, shape, [_Frag(r, g, offset, chunk) for r in range(self.dp)])
                offset += chunk
            have = self._opt[0]["fp32_flat_groups"][g].numel()
            if offset != have:
                raise ConvertError(f"{self.path}: group {g} of param_shapes needs {offset} elements per rank, the "
                                   f"optimizer states hold {have}; model and optimizer files do not match")

    def _index_frozen(self, tag_dir: Path, model: dict) -> None:
        """Parameters with ``requires_grad=False`` (a LoRA base, frozen embeddings): DeepSpeed keeps
        them out of the optimizer, in the model-states files: whole at stage 1/2, at stage 3 each
        rank's flat partition (``ceil(numel / dp)``, the last one padded) in its own file. In the
        stream their Adam moments read as zeros (a converted run trains them from a fresh state)."""
        shapes = model.get("frozen_param_shapes") or {}
        if self.stage < 3:  # at stage 1 DeepSpeed does not record them: any module parameter the
            self._index_unrecorded_frozen(model, shapes)  # optimizer does not hold is one
        if not shapes:
            return
        models = [model]
        if self.stage == 3:
            files = [tag_dir / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(self.dp)]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise ConvertError(f"{tag_dir}: {missing} missing: they hold the frozen parameters' partitions; the "
                                   "checkpoint is incomplete")
            models += [safe_load(f) for f in files[1:]]
        for name, shape in shapes.items():
            parts = [m["frozen_param_fragments"][name].reshape(-1) for m in models]
            self._add(name, shape, [_Frag(r, -1, 0, p.numel(), frozen=p) for r, p in enumerate(parts)])
        self.frozen = set(shapes)

    def _index_unrecorded_frozen(self, model: dict, recorded: dict) -> None:
        """Stage 1/2 save the whole module state dict beside the optimizer's partitions; its
        parameters that neither the optimizer nor ``frozen_param_shapes`` holds were frozen."""
        buffers = set(model.get("buffer_names") or ())
        aliases = set(model.get("shared_params") or {})
        for name, tensor in (model.get("module") or {}).items():
            if name in self.infos or name in recorded or name in buffers or name in aliases:
                continue
            flat = tensor.reshape(-1)
            self._add(name, tuple(tensor.shape), [_Frag(0, -1, 0, flat.numel(), frozen=flat)])
            self.frozen.add(name)

    def _add(self, name: str, shape, frags: list[_Frag]) -> None:
        self.infos[name] = TensorInfo(tuple(shape), torch.float32)
        self._frags[name] = frags

    def _add_shared(self, shared: dict) -> None:
        """DeepSpeed lists a tied weight once, with ``shared_params[alias] = owner``; the canonical
        stream drops the alias when the config ties embeddings, else serves the owner's data."""
        for alias, owner in shared.items():
            if alias == "lm_head.weight" and self.tied:
                continue
            self.infos[alias], self._frags[alias] = self.infos[owner], self._frags[owner]
        if self.tied:
            self.infos.pop("lm_head.weight", None)

    def _unpack_modules(self) -> None:
        """DeepSpeed saves the transformers module's parameters; the canonical names are the
        checkpoint's (MoE experts packed in one parameter become one tensor each): each is a
        contiguous element range of its module parameter, so it keeps only those fragments."""
        layout = module_layout(self.hf_config, {n: i.shape for n, i in self.infos.items()})
        if all(p.module == n for n, p in layout.items()):
            return
        frags = self._frags
        self.infos = {n: TensorInfo(p.shape, torch.float32) for n, p in layout.items()}
        self._frags = {n: _sub_frags(frags[p.module], p.start, p.start + p.numel) for n, p in layout.items()}

    # --- data ---------------------------------------------------------------------------------------

    def _flat(self, rank: int, group: int, state: str) -> torch.Tensor:
        opt = self._opt[rank]
        if state == "param":
            key = "fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"
            return opt[key][group]
        return self._groups_state(rank)["state"][group][state]

    def pieces(self, name: str, state: str = "param", start: int = 0, stop: int | None = None):
        """1-D views into the memory-mapped partitions whose concatenation is elements
        ``[start, stop)`` of the flattened tensor (padding excluded)."""
        stop = math.prod(self.infos[name].shape) if stop is None else stop
        pos = 0
        for f in self._frags[name]:
            lo, hi = max(start, pos), min(stop, pos + f.length)
            if lo < hi and f.frozen is not None and state != "param":
                yield torch.zeros(hi - lo, dtype=torch.float32)  # a frozen parameter has no moments
            elif lo < hi:
                flat = f.frozen if f.frozen is not None else self._flat(f.rank, f.group, state)
                yield flat.narrow(0, f.start + lo - pos, hi - lo)
            pos += f.length

    def read(self, name: str, state: str = "param") -> torch.Tensor:
        """The full tensor, copied piece by piece; the pages read are given back at once."""
        info = self.infos[name]
        out = torch.empty(math.prod(info.shape), dtype=torch.float32)
        pos = 0
        for piece in self.pieces(name, state):
            out[pos:pos + piece.numel()].copy_(piece)
            pos += piece.numel()
            self.maps.release(piece)
        return out.view(info.shape)


def _sub_frags(frags: list[_Frag], start: int, stop: int) -> list[_Frag]:
    """The fragments of elements ``[start, stop)`` of a tensor laid out as ``frags``."""
    out, pos = [], 0
    for f in frags:
        lo, hi = max(start, pos), min(stop, pos + f.length)
        if lo < hi:
            out.append(dataclasses.replace(f, start=f.start + lo - pos, length=hi - lo))
        pos += f.length
    return out


def module_layout(hf_config: dict, module_shapes: dict) -> dict:
    """Checkpoint name -> ``families.Piece`` of a transformers module state (identity for families
    that pack nothing, and for model types without a family)."""
    from toolkit.families import find_family, unpacked_layout
    family = find_family(hf_config.get("model_type"))
    if family is None or not family.packed:
        from toolkit.families import Piece
        return {n: Piece(n, 0, tuple(s)) for n, s in module_shapes.items()}
    return unpacked_layout(family, hf_config_object(hf_config), module_shapes)


def _optimizer_step(groups_state: dict, default: int) -> int:
    """Adam's step count (skipped fp16 steps do not count), else DeepSpeed's global step."""
    step = (groups_state.get("state") or {}).get(0, {}).get("step", default)
    return int(step.item() if isinstance(step, torch.Tensor) else step)


def _hparams(groups_state: dict) -> dict:
    groups = groups_state.get("param_groups") or [{}]
    return {k: groups[0][k] for k in ("lr", "betas", "eps", "weight_decay") if k in groups[0]}


class UniversalSource(Source):
    """DeepSpeed's universal layout (what ``write_zero`` produces, and ``ds_to_universal``)."""

    def __init__(self, tag_dir: Path, hf_config: dict, **kw):
        super().__init__(path=tag_dir, format="zero-universal", hf_config=hf_config, **kw)
        zero = tag_dir / "zero"
        common = safe_load(zero / "optimizer_state.pt", mmap=False)
        meta = common.get("toolkit", {})
        order = meta.get("names") or sorted(p.name for p in zero.iterdir() if p.is_dir())
        shapes = {}
        for name in order:
            if not (zero / name / "fp32.pt").is_file():
                raise ConvertError(f"{zero / name / 'fp32.pt'}: missing; the universal checkpoint is incomplete")
            shapes[name] = tuple(meta["shapes"][name]) if "shapes" in meta else tuple(self._load(name, "fp32").shape)
        if self.tied:
            shapes.pop("lm_head.weight", None)
        self._pieces = module_layout(hf_config, shapes)  # per-parameter folders hold module parameters
        self.infos = {n: TensorInfo(p.shape, torch.float32) for n, p in self._pieces.items()}
        self._cache: tuple | None = None
        self.step = int(meta.get("step", 0))
        self.has_optimizer = bool(meta.get("has_optimizer", True))
        self.layout = dict(meta.get("layout", {"dp": 1, "tp": 1, "pp": 1, "zero_stage": 0}))
        self.optimizer_hparams = dict(meta.get("hparams", {}))

    def _load(self, name: str, key: str) -> torch.Tensor:
        return safe_load(self.path / "zero" / name / f"{key}.pt")["param"]

    def read(self, name: str, state: str = "param") -> torch.Tensor:
        piece, key = self._pieces[name], "fp32" if state == "param" else state
        if self._cache is None or self._cache[0] != (piece.module, key):  # experts of one parameter in turn
            self._cache = ((piece.module, key), self._load(piece.module, key).float().reshape(-1))
        return self._cache[1][piece.start:piece.start + piece.numel].view(piece.shape).clone()


# --- writer: DeepSpeed's universal layout -------------------------------------------------------------

UNIVERSAL_GROUPS = 16
"""``zero/optimizer_state.pt`` lists this many *empty* param groups. DeepSpeed zips them with the
resuming engine's groups and copies their keys over the engine's (stage 3 copies group 0's onto
every group, weight decay included); empty ones keep the resuming run's own hyperparameters."""


def write_zero(source: Source, engine_dir: Path, stage: int, dp: int, weights_only: bool = False,
               progress=None) -> None:
    """``engine_dir/{latest,latest_universal}`` and ``global_stepN/`` in the universal layout;
    without moments (weights only, or an HF source) Adam starts fresh: zero moments, step 0."""
    import deepspeed
    moments = source.has_optimizer and not weights_only
    step = source.step or 0
    opt_step = step if moments else 0
    tag = engine_dir / f"global_step{step}"
    zero = tag / "zero"
    zero.mkdir(parents=True)
    modules = _module_params(source)
    for module, (shape, pieces) in modules.items():
        d = zero / module
        d.mkdir()
        param = _assemble(source, shape, pieces, "param")
        torch.save({"param": param}, d / "fp32.pt")
        for key in ("exp_avg", "exp_avg_sq"):
            torch.save({"param": _assemble(source, shape, pieces, key) if moments else torch.zeros_like(param)},
                       d / f"{key}.pt")
        torch.save(opt_step, d / "step.pt")
        if progress:
            progress(module, param.nbytes * (3 if moments else 1))
    layout = {"dp": dp, "tp": 1, "pp": 1, "zero_stage": stage}
    shapes = {m: list(shape) for m, (shape, _) in modules.items()}
    torch.save({"param_groups": [{} for _ in range(UNIVERSAL_GROUPS)], "ds_version": deepspeed.__version__,
                "optimizer_state_dict": {"state": {0: {"step": opt_step}}, "param_groups": [{}]},
                "toolkit": {"names": list(modules), "shapes": shapes, "step": step, "has_optimizer": moments,
                            "layout": layout, "hparams": source.optimizer_hparams}},
               zero / "optimizer_state.pt")
    model_states = _model_states(shapes, step, dp, deepspeed.__version__)
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        torch.save(model_states, tag / name)  # the stage 1/2 and the stage 3 name: any stage loads it
    for latest in ("latest", "latest_universal"):
        (engine_dir / latest).write_text(tag.name)


def _module_params(source: Source) -> dict[str, tuple[tuple[int, ...], list]]:
    """The transformers module's parameters (what DeepSpeed's engine names): shape, and the
    checkpoint tensors that make each with their ``families.Piece`` (MoE: a layer's experts in one)."""
    from toolkit.families import find_family, pack
    family = find_family(source.model_type)
    metas = {n: torch.empty(source.infos[n].shape, device="meta") for n in source.names()}
    packed = pack(family, hf_config_object(source.hf_config), metas) if family and family.packed else metas
    out = {m: (tuple(t.shape), []) for m, t in packed.items()}
    for name, piece in module_layout(source.hf_config, {m: s for m, (s, _) in out.items()}).items():
        out[piece.module][1].append((name, piece))
    return out


def _assemble(source: Source, shape: tuple[int, ...], pieces, state: str) -> torch.Tensor:
    """One module parameter from its checkpoint tensors, each read in turn into its element range."""
    if len(pieces) == 1 and pieces[0][1].shape == shape:
        return source.read(pieces[0][0], state)
    out = torch.empty(math.prod(shape), dtype=torch.float32)
    for name, piece in pieces:
        out[piece.start:piece.start + piece.numel] = source.read(name, state).reshape(-1)
    return out.view(shape)


def _model_states(shapes: dict, step: int, dp: int, ds_version: str) -> dict:
    """What DeepSpeed's loader reads besides ``zero/``: counters and world sizes (the module itself
    is restored from ``zero/`` in universal mode)."""
    return {"module": {}, "buffer_names": [], "optimizer": None,
            "param_shapes": [{n: torch.Size(s) for n, s in shapes.items()}],
            "frozen_param_shapes": {}, "shared_params": {}, "frozen_param_fragments": {}, "lr_scheduler": None,
            "data_sampler": None, "random_ltd": None, "skipped_steps": 0, "global_steps": step,
            "global_samples": 0, "dp_world_size": dp, "mp_world_size": 1, "ds_version": ds_version,
            "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1}}
