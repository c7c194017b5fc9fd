"""Megatron-core ``torch_dist`` checkpoints (Megatron-LM's legacy per-rank files: ``megatron_legacy.py``).

torch_dist (PyTorch DCP underneath) stores *global* tensors, whatever the TP/PP/DP that wrote
them; a loader at any layout reads the regions it needs. Storage keys and shapes:
  ``embedding.word_embeddings.weight``  ``[padded_vocab, H]`` (padded_vocab depends on the TP
      it is written for: megatron pads to a multiple of ``make_vocab_size_divisible_by * tp``)
  ``decoder.layers.<name>``  ``[L, *full mcore shape]``, stacked over *global* layer numbers;
      the local spec's norms appear under TE names (``input_layernorm.`` ->
      ``self_attention.linear_qkv.layer_norm_``, as its ``sharded_state_dict_keys_map`` says)
  ``decoder.layers.mlp.experts.experts.<linear>.weight``  ``[L, E, *full shape]``: routed experts
      (megatron's SequentialMLP) by global layer and global expert number, whatever the EP
  ``decoder.layers.<linear>._extra_state/shard_<i>_<L>``  one pickled object per layer (experts:
      ``shard_<i>.<e>_<L>.<E>``)
  ``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>``  fp32 main weights and Adam moments in the
      model's layout (distributed optimizer, ``fully_reshardable``); ``common.pt`` holds the
      optimizer's param groups (hyperparameters and ``step``)
The "full mcore" layout of a tensor (fused QKV per KV group, GLU as ``[gate; up]``) is exactly the
family table's TP=1 form, so reading is ``family.to_hf`` and writing is ``family.to_mcore``.
"""
from __future__ import annotations

import io
import json
import math
import warnings
from pathlib import Path

import torch

from toolkit.formats.canonical import Source, TensorInfo, WriteRequest, hf_config_object
from toolkit.formats.describe import (
    megatron_description,
    read_megatron_description,
    write_megatron_description,
)
from toolkit.formats.errors import ConvertError
from toolkit.formats.pages import SourceMaps, give_back
from toolkit.formats.safeload import safe_load
from toolkit.heap import trim_heap
from toolkit.layout import Layout

KEYS_MAP = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
            "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
"""megatron-core's local layer spec ``sharded_state_dict_keys_map`` (a test checks it against the
spec itself; importing megatron here would cost seconds for a constant)."""
LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""Layer modules (attention, MLP, each routed or shared expert) with an ``_extra_state`` entry in
the checkpoint, one per layer (and expert): ``<key>._extra_state/shard_<index>_<stacked shape>``."""
OPT_PREFIX = "optimizer.state."


STORED_EXPERTS = "mlp.experts.experts."
"""megatron's SequentialMLP stores its local experts under this name, with an expert axis."""


def storage_key(mcore_name: str) -> tuple[str, tuple[int, ...]]:
    """Full mcore name (global layer and expert numbers) -> (storage key, its index in the stored
    tensor's leading dims): ``()`` for a top-level tensor, ``(layer,)``, or ``(layer, expert)``."""
    from toolkit.families import split_expert
    if not mcore_name.startswith("decoder.layers."):
        return mcore_name, ()
    expert = split_expert(mcore_name)
    if expert is not None:
        return f"decoder.layers.{STORED_EXPERTS}{expert[2]}", expert[:2]
    _, _, layer, rest = mcore_name.split(".", 3)
    for old, new in KEYS_MAP.items():
        if rest.startswith(old):
            rest = new + rest[len(old):]
    return f"decoder.layers.{rest}", (int(layer),)


class _McoreNames:
    """The family table of one HF config: mcore name -> entry; HF name -> mcore name."""

    def __init__(self, hf_config: dict, padded_vocab: int):
        from toolkit.families import FamilyError, get_family, table
        self.config = hf_config_object(hf_config)
        try:
            self.family = get_family(self.config.model_type)
            self.family.check(self.config)  # fields the megatron model cannot honour, named
        except FamilyError as exc:
            raise ConvertError(str(exc)) from None
        self.dims = self.family.dims(self.config, padded_vocab)
        self.padded_vocab = padded_vocab
        self.entries = table(self.family, self.config)  # mcore name -> (entry, hf prefix)
        self.owner = {hp + n: m for m, (e, hp) in self.entries.items() for n in e.hf_names()}

    def hf_names(self) -> list[str]:
        return list(self.owner)

    def to_mcore(self, mcore_name: str, read) -> torch.Tensor:
        entry, hp = self.entries[mcore_name]
        return entry.to_mcore({n: read(hp + n) for n in entry.hf_names()}, self.dims)

    def to_hf(self, mcore_name: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
        entry, hp = self.entries[mcore_name]
        return {hp + k: v for k, v in entry.to_hf(x, self.dims).items()}


# --- reader --------------------------------------------------------------------------------------------

class _RegionPlanner:
    """DCP load planner that places the requested regions into one preallocated tensor."""

    def __init__(self, target: torch.Tensor):
        self.target = target

    def resolve_tensor(self, read_item):
        return self.target[tuple(slice(o, o + n) for o, n in zip(read_item.dest_offsets, read_item.lengths))]

    def commit_tensor(self, read_item, tensor):
        pass

    def load_bytes(self, read_item, value):
        self.bytes = value.read()


def open_dist(path: Path):
    """(FileSystemReader, its metadata) of a torch_dist directory, ready to read regions."""
    from torch.distributed.checkpoint import FileSystemReader

    from toolkit.formats.dcp_metadata import load_metadata
    reader = FileSystemReader(str(path))
    md = load_metadata(path)  # allowlisted: FileSystemReader.read_metadata is a bare pickle.load
    reader.set_up_storage_reader(md, True)
    return reader, md


def read_region(reader, md, key: str, index: tuple[int, ...] = ()) -> torch.Tensor:
    """The stored global tensor ``key`` at ``index`` of its leading (layer, expert) dims (all of it
    for ``()``), read from whatever chunks the writing ranks left."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
    meta = md.state_dict_metadata[key]
    size = [1] * len(index) + list(meta.size)[len(index):]
    offsets = list(index) + [0] * (len(size) - len(index))
    target = torch.empty(size, dtype=meta.properties.dtype)
    items = create_read_items_for_chunk_list(key, meta, [ChunkStorageMetadata(torch.Size(offsets), torch.Size(size))])
    reader.read_data(LoadPlan(items), _RegionPlanner(target)).wait()
    return target.reshape(size[len(index):])


class MegatronSource(Source):
    """A torch_dist directory; each tensor is read as the one region (a layer) it occupies."""

    def __init__(self, path: Path, hf_config: dict, **kw):
        super().__init__(path=path, format="megatron-torch_dist", hf_config=hf_config, **kw)
        self._reader, self._md = open_dist(path)
        tk = read_megatron_description(path)
        self._check_family(tk)
        emb = self._md.state_dict_metadata.get("embedding.word_embeddings.weight")
        if emb is None:
            raise ConvertError(f"{path}: no embedding.word_embeddings.weight; not a GPT model checkpoint")
        self.layout_ = _McoreNames(hf_config, int(emb.size[0]))
        self._check_keys()
        self.layout = {k: v for k, v in tk.get("layout", {}).items() if k != "format"}
        self.vocab_divisor = tk.get("make_vocab_size_divisible_by")  # absent: written before it was recorded
        self.has_optimizer = any(k.startswith(OPT_PREFIX + "exp_avg.") for k in self._md.state_dict_metadata)
        common = safe_load(path / "common.pt", mmap=False) if (path / "common.pt").is_file() else {}
        groups = common.get("optimizer", {}).get("optimizer", {}).get("param_groups", [])
        self.param_groups = groups
        self.step = int(groups[0].get("step", 0)) if groups else (kw.get("trainer_state") or {}).get("step")
        self.optimizer_hparams = {k: groups[0][k] for k in ("lr", "betas", "eps") if groups and k in groups[0]}
        if groups:  # the matrices' rate: megatron-core orders its groups by their settings (no-decay may be first)
            self.optimizer_hparams["weight_decay"] = max(float(g.get("weight_decay", 0.0)) for g in groups)
        for name in self.layout_.hf_names():
            self.infos[name] = TensorInfo(self._hf_shape(name), self._dtype(name))
        self._cache: tuple | None = None

    def _check_family(self, tk: dict) -> None:
        fam = tk.get("family")
        if fam and fam != self.hf_config.get("model_type"):
            raise ConvertError(f"{self.path}: written for family {fam!r}, but the HF config says "
                               f"model_type={self.hf_config.get('model_type')!r}; pass the matching --hf-config")
        vocab = tk.get("vocab_size")
        if vocab and vocab != self.hf_config.get("vocab_size"):
            raise ConvertError(f"{self.path}: written with vocab_size={vocab}, the HF config says "
                               f"{self.hf_config.get('vocab_size')}; pass the matching --hf-config")

    def _check_keys(self) -> None:
        """Strict: the stored model tensors are exactly the family table's, with its shapes."""
        want = {}
        for m in self.layout_.entries:
            key, index = storage_key(m)
            want.setdefault(key, set()).add(index)
        have = {k for k, v in self._md.state_dict_metadata.items()
                if hasattr(v, "size") and not k.startswith("optimizer.")}
        missing, unexpected = sorted(set(want) - have), sorted(have - set(want))
        if missing or unexpected:
            raise ConvertError(f"{self.path}: tensors do not match the {self.layout_.family.model_type} family table "
                               f"(wrong family or --hf-config?); missing {missing[:8]}, unexpected {unexpected[:8]}")

    def _region(self, key: str, index: tuple[int, ...]) -> torch.Tensor:
        return read_region(self._reader, self._md, key, index)

    def _hf_shape(self, name: str) -> tuple[int, ...]:
        m = self.layout_.owner[name]
        key, index = storage_key(m)
        size = list(self._md.state_dict_metadata[key].size)
        meta = torch.empty(size[len(index):], device="meta")
        return tuple(self.layout_.to_hf(m, meta)[name].shape)

    def _dtype(self, name: str) -> torch.dtype:
        key, _ = storage_key(self.layout_.owner[name])
        opt = self._md.state_dict_metadata.get(f"{OPT_PREFIX}param.{key}")
        return (opt or self._md.state_dict_metadata[key]).properties.dtype

    def _stored(self, key: str, state: str) -> str:
        """Weights come from the fp32 main copy when the optimizer state holds one."""
        if state == "param":
            main = f"{OPT_PREFIX}param.{key}"
            return main if main in self._md.state_dict_metadata else key
        return f"{OPT_PREFIX}{state}.{key}"

    def read(self, name: str, state: str = "param") -> torch.Tensor:
        """One HF tensor; an entry's other HF tensors (q of k, v) come from the same decoded region."""
        m = self.layout_.owner[name]
        key, index = storage_key(m)
        stored = self._stored(key, state)
        if self._cache is None or self._cache[0] != (m, stored):
            self._cache = None  # the last region goes before the next is read, and its heap pages with it
            trim_heap()
            decoded = self.layout_.to_hf(m, self._region(stored, index))
            if len(decoded) == 1:  # nothing else to serve from this region: the caller gets it, no copy
                return decoded[name].float()
            self._cache = ((m, stored), decoded)
        return self._cache[1][name].float().clone()


# --- writer --------------------------------------------------------------------------------------------

class _StreamingSavePlanner:
    """A DCP save planner whose items are per-layer regions computed from the source on demand:
    DCP's writer resolves one item at a time, so memory holds one layer's tensor, not the model."""

    def __new__(cls, *args, **kw):
        from torch.distributed.checkpoint import DefaultSavePlanner

        class Planner(DefaultSavePlanner):
            def __init__(self, items, resolve):
                super().__init__()
                self._items, self._resolve = items, resolve

            def create_local_plan(self):
                from torch.distributed.checkpoint.planner import SavePlan
                self.plan = SavePlan(self._items, planner_data={})
                return self.plan

            def resolve_data(self, write_item):
                return self._resolve(write_item)

        return Planner(*args, **kw)


def write(source: Source, engine_dir: Path, request: WriteRequest, progress=None) -> dict:
    """The table's writer (``table.Format.write``): ``write_megatron`` at the request's layout (its
    vocabulary divisor included); returns the layout record."""
    return write_megatron(source, engine_dir, layout=request.layout, dtype=request.dtype,
                          weights_only=request.weights_only, progress=progress)["layout"]


def write_megatron(source: Source, engine_dir: Path, *, layout: Layout, dtype: torch.dtype | None = None,
                   weights_only: bool = False, progress=None) -> dict:
    """``engine_dir`` as a megatron-core torch_dist checkpoint for a run at ``layout``: its tp and
    vocabulary divisor pad the vocabulary (``Layout.padded``); pp, ep and dp only go into the
    description - the tensors are global."""
    import torch.distributed.checkpoint as dcp

    if layout.backend != "megatron":  # its record() would describe a ZeRO checkpoint
        raise ValueError(f"write_megatron needs a megatron layout, got {layout.describe()}")
    names = _McoreNames(source.hf_config, layout.padded(source.hf_config["vocab_size"]))
    _check_names(source, names)
    moments = source.has_optimizer and not weights_only
    items, resolvers = _plan(source, names, dtype, moments)

    written: list[torch.Tensor] = []
    source_maps = SourceMaps(source.path)

    def resolve(item):
        # DCP's serial writer keeps a reference to every tensor it wrote (a dict for its safetensors
        # format, unused here); it asks for item i+1 only after writing item i, so the storage of
        # item i is freed here, keeping memory at one region instead of the whole model, and the
        # pages it held go back to the OS (pages.give_back: else they stay resident).
        while written:
            written.pop().untyped_storage().resize_(0)
        give_back(source_maps)
        value = resolvers[(item.index.fqn, tuple(item.index.offset or ()))]()
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            if storage.nbytes() != value.nbytes or not storage.resizable():
                value = value.clone()  # its own storage, so freeing it frees no one else's
            written.append(value)
            if progress:
                progress(item.index.fqn, value.nbytes)
        return value

    engine_dir.mkdir(parents=True)
    writer = dcp.FileSystemWriter(str(engine_dir), single_file_per_rank=True, thread_count=1)
    with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({}, storage_writer=writer, planner=_StreamingSavePlanner(items, resolve), no_dist=True)
    write_dist_metadata(engine_dir)
    torch.save(_common(source, moments), engine_dir / "common.pt")
    describe = megatron_description(names.family.model_type, source.hf_config["vocab_size"], names.padded_vocab,
                                    layout.vocab_divisor, layout.record())
    write_megatron_description(engine_dir, describe)
    return describe


def write_dist_metadata(engine_dir: Path) -> None:
    """``metadata.json``: what megatron-core's ``dist_checkpointing`` reads first (its backends)."""
    (engine_dir / "metadata.json").write_text(json.dumps(
        {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
         "common_backend_version": 1}))


def _check_names(source: Source, layout: _McoreNames) -> None:
    want, have = set(layout.hf_names()), set(source.names())
    if want != have:
        raise ConvertError(f"{source.path}: tensors do not match the {layout.family.model_type} family table "
                           f"(wrong family or --hf-config?); missing {sorted(want - have)[:8]}, "
                           f"unexpected {sorted(have - want)[:8]}")


ROW_BLOCK_BYTES = 16 << 20
"""Top-level matrices (the vocabulary ones above all) are written in row blocks of about this size,
so the largest tensors never sit in memory whole."""


def _plan(source: Source, layout: _McoreNames, dtype, moments: bool):
    """DCP write items (per layer of a stacked key, per row block of a top-level matrix, else per
    tensor) and how to compute each."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
    layers = source.hf_config.get("num_hidden_layers", source.hf_config.get("n_layer"))
    items, resolvers = [], {}
    states = [("param", dtype)] + ([("main", torch.float32), ("exp_avg", torch.float32),
                                    ("exp_avg_sq", torch.float32)] if moments else [])
    stacked = (layers, layout.family.num_experts(layout.config))
    for m in layout.entries:
        key, index = storage_key(m)
        shape = tuple(layout.to_mcore(m, lambda n: torch.empty(source.infos[n].shape, device="meta")).shape)
        for state, dt in states:
            dt = dt or torch.float32
            fqn = key if state == "param" else f"{OPT_PREFIX}{'param' if state == 'main' else state}.{key}"
            read_state = "param" if state == "main" else state
            for offsets, sizes, full, compute in _regions(source, layout, m, shape, index, stacked, read_state, dt):
                items.append(WriteItem(MetadataIndex(fqn, torch.Size(offsets)), WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(ChunkStorageMetadata(torch.Size(offsets),
                                                                                        torch.Size(sizes)),
                                                                   TensorProperties(dtype=dt), torch.Size(full))))
                resolvers[(fqn, offsets)] = compute
    for fqn in _extra_states(layout, stacked):
        items.append(WriteItem(MetadataIndex(fqn), WriteItemType.BYTE_IO))
        resolvers[(fqn, ())] = _extra_state_bytes
    return items, resolvers


def _extra_states(layout: _McoreNames, stacked: tuple[int, int]) -> list[str]:
    """The ``_extra_state`` entries megatron writes for the linears of the family table."""
    out = []
    for m in layout.entries:
        key, index = storage_key(m)
        module, _, param = key.rpartition(".")
        if index and param == "weight" and module.rpartition(".")[2] in LINEARS:
            where = ".".join(map(str, index)), ".".join(map(str, stacked[:len(index)]))
            out.append(f"{module}._extra_state/shard_{where[0]}_{where[1]}")
    return out


def _regions(source, layout, m, shape, index, stacked, state, dtype):
    """(offsets, sizes, global shape, compute) of the chunks one stored tensor is written as.
    ``index``: the tensor's place in the leading (layer, expert) dims of size ``stacked``."""
    if index:  # one layer (or one expert of one layer) of the stacked [L, (E,) ...] tensor
        lead = (1,) * len(index)

        def one_region():
            return layout.to_mcore(m, lambda n: source.read(n, state)).to(dtype).contiguous().reshape(*lead, *shape)
        yield (*index, *[0] * len(shape)), (*lead, *shape), (*stacked[:len(index)], *shape), one_region
        return
    entry, prefix = layout.entries[m]
    rows_per = max(1, ROW_BLOCK_BYTES // max(1, 4 * math.prod(shape[1:]))) if len(shape) == 2 else 0
    if not rows_per or getattr(entry, "transpose", True) or len(entry.hf_names()) != 1 or shape[0] <= rows_per:
        def whole():
            return layout.to_mcore(m, lambda n: source.read(n, state)).to(dtype).contiguous()
        yield (0,) * len(shape), shape, shape, whole
        return
    name = prefix + entry.hf_names()[0]  # a plain rename: rows beyond the HF tensor are vocab padding
    for lo in range(0, shape[0], rows_per):
        hi = min(lo + rows_per, shape[0])
        yield (lo, 0), (hi - lo, shape[1]), shape, _row_block(source, name, state, lo, hi, shape[1], dtype)


def _row_block(source, name, state, lo, hi, width, dtype):
    def compute():
        have = source.infos[name].shape[0]
        out = torch.zeros(hi - lo, width, dtype=dtype)
        if lo < have:
            out[:min(hi, have) - lo] = _rows(source, name, state, lo, min(hi, have), width)
        return out
    return compute


def _rows(source, name, state, lo, hi, width) -> torch.Tensor:
    """Rows ``[lo, hi)`` of a source tensor: from its memory-mapped pieces or its safetensors slice
    when it has them (an HF source: reading only these rows, not the whole matrix per block)."""
    if hasattr(source, "slice_of") and state == "param":
        return source.slice_of(name)[lo:hi]
    if not hasattr(source, "pieces"):
        return source.read(name, state)[lo:hi]
    out = torch.empty((hi - lo) * width, dtype=torch.float32)
    pos = 0
    for piece in source.pieces(name, state, lo * width, hi * width):
        out[pos:pos + piece.numel()].copy_(piece)
        pos += piece.numel()
        source.maps.release(piece)
    return out.view(hi - lo, width)


def _extra_state_bytes() -> io.BytesIO:
    """A local-spec linear's extra state: nothing (megatron stores its ShardedObject as ``[None]``)."""
    buf = io.BytesIO()
    torch.save([None], buf)
    buf.seek(0)
    return buf


def _common(source: Source, moments: bool) -> dict:
    """common.pt: the optimizer's two param groups (decayed, not decayed) as megatron-core's
    distributed optimizer writes them, with the source's hyperparameters and step."""
    if not moments:
        return {}
    groups = getattr(source, "param_groups", None)
    if groups:  # megatron -> megatron: the groups as they were
        return {"optimizer": {"optimizer": {"param_groups": groups}, "param_state_sharding_type": "fully_reshardable"}}
    hp = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, **source.optimizer_hparams}
    base = {"is_expert_parallel": False, "default_config": True, "lr_mult": 1.0, "is_decoupled_lr": False,
            "max_lr": hp["lr"], "min_lr": 0.0, "lr": hp["lr"], "betas": tuple(hp["betas"]), "eps": hp["eps"],
            "weight_decay": hp["weight_decay"], "amsgrad": False, "maximize": False, "foreach": None,
            "capturable": False, "differentiable": False, "fused": None, "decoupled_weight_decay": True,
            "step": float(source.step or 0)}
    groups = [{**base, "wd_mult": 1.0}, {**base, "wd_mult": 0.0}]
    return {"optimizer": {"optimizer": {"param_groups": groups}, "param_state_sharding_type": "fully_reshardable"}}
