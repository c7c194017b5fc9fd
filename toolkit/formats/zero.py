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

Where each parameter lies in the native layout is worked out in ``zero_index.py`` (torch-free, also
used by the direct ZeRO -> HF copy in ``direct.py``).

Universal layout (written here, and read back): ``TAG/zero/<HF name>/{fp32,exp_avg,exp_avg_sq}.pt``
each ``{"param": full tensor}``, ``step.pt``, plus ``zero/optimizer_state.pt``; DeepSpeed loads it at
any DP size and stage with ``"checkpoint": {"load_universal": true}``.
"""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import torch

from toolkit.formats.canonical import Source, TensorInfo, WriteRequest, hf_config_object
from toolkit.formats.describe import layout_record, universal_layout
from toolkit.formats.errors import ConvertError
from toolkit.formats.pages import FileMaps, SourceMaps, give_back
from toolkit.formats.safeload import safe_load
from toolkit.formats.zero_index import ZeroIndex, spans, sub_frags
from toolkit.layout import Layout

READ_BLOCK = 4 << 20
"""Elements (16 MB of fp32) copied out of a memory-mapped partition before its pages are given back."""


class ZeroSource(Source):
    """A native DeepSpeed ZeRO 1/2/3 checkpoint; tensors are gathered from memory-mapped partitions
    where ``zero_index.ZeroIndex`` says they lie."""

    def __init__(self, tag_dir: Path, hf_config: dict, **kw):
        super().__init__(path=tag_dir, format="zero", hf_config=hf_config, **kw)
        self.index = ZeroIndex(tag_dir, safe_load, self.tied)
        self.stage, self.dp, self.frozen = self.index.stage, self.index.dp, self.index.frozen
        self.files = self.index.files
        self.has_optimizer = True
        self.layout = layout_record("deepspeed", dp=self.dp, zero_stage=self.stage,
                                    ep=self.index.autoep.ep if self.index.autoep else 1)
        self.infos = {n: TensorInfo(s, torch.float32) for n, s in self.index.shapes.items()}
        self._frags = self.index.frags
        self._unpack_modules()
        self.maps = FileMaps()  # after every file is mapped: they live as long as this reader
        self.optimizer_hparams = self.index.hparams
        self.step = self.index.step

    def _unpack_modules(self) -> None:
        """DeepSpeed saves the transformers module's parameters; the canonical names are the
        checkpoint's (MoE experts packed in one parameter become one tensor each): each is a
        contiguous element range of its module parameter, so it keeps only those fragments."""
        layout = module_layout(self.hf_config, {n: i.shape for n, i in self.infos.items()})
        if all(p.module == n for n, p in layout.items()):
            return
        frags = self._frags
        self.infos = {n: TensorInfo(p.shape, torch.float32) for n, p in layout.items()}
        self._frags = {n: sub_frags(frags[p.module], p.start, p.start + p.numel) for n, p in layout.items()}

    # --- data ---------------------------------------------------------------------------------------

    def pieces(self, name: str, state: str = "param", start: int = 0, stop: int | None = None):
        """1-D views into the memory-mapped partitions whose concatenation is elements
        ``[start, stop)`` of the flattened tensor (padding excluded)."""
        stop = math.prod(self.infos[name].shape) if stop is None else stop
        for f, first, count in spans(self._frags[name], start, stop):
            if f.frozen is not None and state != "param":
                yield torch.zeros(count, dtype=torch.float32)  # a frozen parameter has no moments
            else:
                yield self.index.holder(f, state).reshape(-1).narrow(0, first, count)

    def read(self, name: str, state: str = "param") -> torch.Tensor:
        """The full tensor, copied piece by piece; the pages read are given back at once."""
        info = self.infos[name]
        out = torch.empty(math.prod(info.shape), dtype=torch.float32)
        pos = 0
        for piece in self.pieces(name, state):
            for block in piece.split(READ_BLOCK):  # pages mapped in per block, not per partition
                out[pos:pos + block.numel()].copy_(block)
                pos += block.numel()
                self.maps.release(block)
        return out.view(info.shape)


def module_layout(hf_config: dict, module_shapes: dict) -> dict:
    """Checkpoint name -> ``families.Piece`` of a transformers module state (identity for families
    that pack nothing, and for model types without a family)."""
    from toolkit.families import find_family, unpacked_layout
    family = find_family(hf_config.get("model_type"))
    if family is None or not family.packed:
        from toolkit.families import Piece
        return {n: Piece(n, 0, tuple(s)) for n, s in module_shapes.items()}
    return unpacked_layout(family, hf_config_object(hf_config), module_shapes)


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
        self._folders = {name: [name] for name in shapes}
        """Module parameter -> the folders it is read from (an AutoEP checkpoint's fused experts: two, on dim 1)."""
        if any(name.endswith(".experts.w1") for name in shapes):
            shapes = self._autoep_as_transformers(shapes)
        if self.tied:
            shapes.pop("lm_head.weight", None)
        self._pieces = module_layout(hf_config, shapes)  # per-parameter folders hold module parameters
        self.infos = {n: TensorInfo(p.shape, torch.float32) for n, p in self._pieces.items()}
        self._cache: tuple | None = None
        self.step = int(meta.get("step", 0))
        self.has_optimizer = bool(meta.get("has_optimizer", True))
        self.layout = universal_layout(meta)
        self.optimizer_hparams = dict(meta.get("hparams", {}))

    def _autoep_as_transformers(self, shapes: dict) -> dict:
        """A universal checkpoint for a ``zero.ep`` run (``as_autoep``) in transformers' module names and
        shapes (``zero_autoep.py``'s table; the router's alias dropped)."""
        from toolkit.formats.zero_autoep import AUTOEP_EXPERTS, ROUTER_ALIAS, hf_name
        blocks = {n[:-len(".experts.w1")] for n in shapes if n.endswith(".experts.w1")}
        out, folders = {}, {}
        for name, shape in shapes.items():
            block, _, part = name.rpartition(".experts.")
            if block in blocks and part in ("w1", "w2", "w3"):
                for fused, parts in AUTOEP_EXPERTS.items():
                    if part == parts[0]:
                        names = [f"{block}.experts.{p}" for p in parts]
                        out[f"{block}.experts.{fused}"] = (shape[0], sum(shapes[n][1] for n in names), *shape[2:])
                        folders[f"{block}.experts.{fused}"] = names
            elif not any(name == f"{b}.{ROUTER_ALIAS}" for b in blocks):
                out[hf_name(name, blocks)], folders[hf_name(name, blocks)] = shape, [name]
        self._folders = folders
        return out

    def _load(self, name: str, key: str) -> torch.Tensor:
        folders = getattr(self, "_folders", {}).get(name, [name])
        parts = [safe_load(self.path / "zero" / folder / f"{key}.pt")["param"] for folder in folders]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

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


def write(source: Source, engine_dir: Path, request: WriteRequest, progress=None) -> dict:
    """The table's writer (``table.Format.write``): ``write_zero`` at the request's layout."""
    return write_zero(source, engine_dir, layout=request.layout, weights_only=request.weights_only, progress=progress)


def write_zero(source: Source, engine_dir: Path, *, layout: Layout, weights_only: bool = False,
               progress=None, module_state: dict | None = None) -> dict:
    """``engine_dir/{latest,latest_universal}`` and ``global_stepN/`` in the universal layout, for
    ``layout``'s ZeRO stage and partitions (dp x sp); without moments (weights only, or an HF source)
    Adam starts fresh: zero moments, step 0. ``module_state``: tensors for the model states' ``module``
    (a LoRA load checks its names there). Returns the layout record it wrote."""
    from importlib.metadata import version
    ds_version = version("deepspeed")  # recorded as DeepSpeed records it (its import is not needed to write)
    moments = source.has_optimizer and not weights_only
    step = source.step or 0
    opt_step = step if moments else 0
    tag = engine_dir / f"global_step{step}"
    zero = tag / "zero"
    zero.mkdir(parents=True)
    modules = _module_params(source)
    source_maps = SourceMaps(source.path)
    for module, (shape, pieces) in modules.items():
        d = zero / module
        d.mkdir()
        _save_state(source, shape, pieces, "param", d / "fp32.pt", source_maps)
        for key in ("exp_avg", "exp_avg_sq"):
            _save_state(source, shape, pieces, key if moments else None, d / f"{key}.pt", source_maps)
        torch.save(opt_step, d / "step.pt")
        if progress:
            progress(module, _dtype(source, shape, pieces).itemsize * math.prod(shape) * (3 if moments else 1))
    dp = layout.zero_partitions
    record = layout_record("deepspeed", dp=dp, zero_stage=layout.zero_stage, ep=layout.ep)
    if layout.ep > 1:  # a zero.ep run's engine: AutoEP's module names, and its per-expert files
        modules = as_autoep(tag, modules)
    shapes = {m: list(shape) for m, (shape, _) in modules.items()}
    torch.save({"param_groups": [{} for _ in range(UNIVERSAL_GROUPS)], "ds_version": ds_version,
                "optimizer_state_dict": {"state": {0: {"step": opt_step}}, "param_groups": [{}]},
                "toolkit": {"names": list(modules), "shapes": shapes, "step": step, "has_optimizer": moments,
                            "layout": record, "hparams": source.optimizer_hparams}},
               zero / "optimizer_state.pt")
    model_states = {**_model_states(shapes, step, dp, ds_version), "module": dict(module_state or {})}
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        torch.save(model_states, tag / name)  # the stage 1/2 and the stage 3 name: any stage loads it
    for latest in ("latest", "latest_universal"):
        (engine_dir / latest).write_text(tag.name)
    return record


def as_autoep(tag: Path, modules: dict) -> dict:
    """The universal folder ``tag/zero/`` written in transformers' module names, as a ``zero.ep`` engine
    (DeepSpeed's AutoEP) loads it: each block's ``gate_up_proj`` split into ``w1``/``w3`` and ``down_proj``
    as ``w2``, full ``[E, ...]`` marked as expert parameters (DeepSpeed's universal load slices each EP
    rank's experts), the router under both of AutoEP's names, the shared expert renamed (``zero_autoep.py``'s
    table, reversed); plus ``layer_L_expert_E_mp_rank_00_model_states.pt`` per expert, which DeepSpeed
    reads for the module's expert weights before the fp32 masters. Returns ``modules`` renamed."""
    zero = tag / "zero"
    blocks = [n[:-len(".experts.gate_up_proj")] for n in modules if n.endswith(".experts.gate_up_proj")]
    renamed = {}
    for name, value in modules.items():
        block = next((b for b in blocks if name.startswith(b + ".")), None)
        if block is None:
            renamed[name] = value
            continue
        rest = name[len(block) + 1:]
        if rest.startswith("experts."):
            continue  # below, per block
        for autoep in _autoep_names(rest):
            target = f"{block}.{autoep}"
            shutil.copytree(zero / name, zero / target)
            renamed[target] = value
        shutil.rmtree(zero / name)
    for layer_id, block in enumerate(blocks):
        renamed.update(_split_experts(zero, tag, block, layer_id, modules))
    return renamed


def _autoep_names(rest: str) -> list[str]:
    """AutoEP's names of a transformers parameter within a MoE block (the router: both of them)."""
    from toolkit.formats.zero_autoep import AUTOEP_RENAMES
    return [autoep + rest[len(hf):] for autoep, hf in AUTOEP_RENAMES if rest.startswith(hf)] or [rest]


def _split_experts(zero: Path, tag: Path, block: str, layer_id: int, modules: dict) -> dict:
    """One block's fused experts as AutoEP's w1/w3/w2 in ``zero/``, and the per-expert model-states files."""
    from toolkit.formats.zero_autoep import AUTOEP_EXPERTS
    out, weights = {}, {}
    for fused, parts in AUTOEP_EXPERTS.items():
        source = zero / f"{block}.experts.{fused}"
        shape = modules[f"{block}.experts.{fused}"][0]
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            whole = torch.load(source / f"{state}.pt", weights_only=True)["param"]
            for part, tensor in zip(parts, whole.chunk(len(parts), dim=1)):
                (zero / f"{block}.experts.{part}").mkdir(exist_ok=True)
                torch.save({"param": tensor.contiguous(), "cat_dim": 0, "is_expert_param": True,
                            "ep_num_experts": shape[0]}, zero / f"{block}.experts.{part}" / f"{state}.pt")
                if state == "fp32":
                    weights[part] = tensor
        for part in parts:
            shutil.copyfile(source / "step.pt", zero / f"{block}.experts.{part}" / "step.pt")
            out[f"{block}.experts.{part}"] = (tuple(weights[part].shape), [])
        shutil.rmtree(source)
    for e in range(next(iter(weights.values())).shape[0]):
        torch.save({f"{block}.experts.{p}.{e}": weights[p][e].clone() for p in ("w1", "w2", "w3")},
                   tag / f"layer_{layer_id}_expert_{e}_mp_rank_00_model_states.pt")
    return out


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


def _save_state(source: Source, shape: tuple[int, ...], pieces, state: str | None, file: Path,
                source_maps: SourceMaps) -> None:
    """One universal file ``{"param": tensor}`` (zeros when ``state`` is None); one tensor in memory
    at a time, its pages given back once written (``pages.give_back``)."""
    tensor = _assemble(source, shape, pieces, state) if state else torch.zeros(shape, dtype=_dtype(source, shape, pieces))
    torch.save({"param": tensor}, file)
    del tensor
    give_back(source_maps)


def _dtype(source: Source, shape: tuple[int, ...], pieces) -> torch.dtype:
    """The dtype ``_assemble`` gives: a lone source tensor's own, else fp32."""
    whole = len(pieces) == 1 and pieces[0][1].shape == shape
    return source.infos[pieces[0][0]].dtype if whole else torch.float32


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
