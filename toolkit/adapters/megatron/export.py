"""The megatron engine's weights (or another attribute of its parameters: gradients, loaded Adam
moments) as HF checkpoint tensors, one megatron tensor at a time, and ``hf_final/``.

A tensor's TP shards are gathered inside the TP group that holds it (its pipeline stage, the DP /
expert-DP replica an export takes) to that group's TP rank 0, which unshards it and sends it to
global rank 0; no other rank takes part. So no rank holds more than one full tensor beyond its own
shards, and no collective spans ranks that have nothing to give.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from toolkit import device
from toolkit.adapters.megatron import grid
from toolkit.adapters.megatron.weights import (
    expert_offset,
    global_name,
    is_expert,
    layer_offset,
    local_params,
)
from toolkit.formats.canonical import Source, TensorInfo
from toolkit.heap import trim_heap

MAX_DIMS = 8  # of a tensor's shape, sent ahead of its data


def hf_state(engine, attr: str | None = None) -> dict[str, torch.Tensor] | None:
    """Every tensor (or ``attr`` of each parameter: ``main_grad``, complete at dp=1 or after
    ``forward_backward(..., complete_grads=True)``) as an HF state dict on rank 0, None elsewhere;
    a tied model also gets ``lm_head.weight``, as HF's own state dict has. Collective."""
    source = MegatronSource(engine, attr)
    state = {name: source.read(name) for name in source.infos}
    if dist.get_rank() != 0:
        return None
    if engine.family.tied(engine.hf_config):
        state["lm_head.weight"] = engine_embedding(state)
    return state


def engine_embedding(state: dict) -> torch.Tensor:
    return next(t for n, t in state.items() if n.endswith(("embed_tokens.weight", "wte.weight")))


def export_hf(engine, path: Path, tokenizer, beat=None) -> None:
    """Collective: ``path`` as the converter's HF writer writes it (fp32, checkpoint names). A LoRA
    run writes the merged model there and its adapter as an HF-PEFT directory beside it
    (``adapter/``), every TP shard of every adapter joined (``export_lora``)."""
    from transformers import GenerationConfig

    from toolkit.adapters.export import write_streamed
    generation = GenerationConfig.from_model_config(engine.hf_config)
    if engine.lora is not None:
        export_lora(engine, Path(path), tokenizer, generation, beat)
        return
    write_streamed(MegatronSource(engine), path, tokenizer, generation, beat=beat)


def export_lora(engine, path: Path, tokenizer, generation, beat=None) -> None:
    """Collective: ``hf_final/`` and ``adapter/`` with the DeepSpeed path's writers
    (``adapters/export.py``): the trained tensors (adapters joined over TP and gathered from every
    stage, modules to save) whole on rank 0, in peft's names, with peft's model of the base on the
    meta device for the names and scalings; the merge onto a pretrained base reads it from its files
    (bf16 runs do not round weights they never changed), onto a random init from the engine."""
    from toolkit.adapters.export import write_adapter, write_merged, write_streamed
    from toolkit.adapters.hf import model_dir
    from toolkit.adapters.megatron.lora import gather_adapters
    from toolkit.lora.peft import peft_config, peft_skeleton
    trained = {**trained_in_full(engine), **(gather_adapters(engine) or {})}  # collective; whole on rank 0
    model, trained = (peft_skeleton(engine.hf_config, peft_config(engine.lora)), trained) if dist.get_rank() == 0 \
        else (None, None)
    m = engine.cfg.model
    base = model_dir(m.name_or_path) if m.init == "pretrained" else None
    if base is not None:
        write_merged(model, trained, path, tokenizer, generation, base=base, beat=beat)
    else:
        write_streamed(MergedLoraSource(engine, model, trained), path, tokenizer, generation, beat=beat)
    write_adapter(model, path.parent / "adapter", trained, base_name=m.name_or_path if base else None)


def trained_in_full(engine) -> dict[str, torch.Tensor]:
    """Collective: the modules to save's trained tensors (the optimizer's fp32 main copies, joined
    over TP) under peft's names, on rank 0 ({} elsewhere)."""
    from toolkit.adapters.megatron.lora import main_params
    from toolkit.lora.geometry import megatron_saved
    from toolkit.lora.peft import ADAPTER, PEFT_PREFIX
    saved = megatron_saved(engine.family, engine.hf_config, engine.lora)
    params = [p for chunk in engine.model for n, p in chunk.module.named_parameters() if n in saved]
    for param, main in zip(params, main_params(engine, params)):  # the same order on the DP ranks
        param.fp32_main = main
    out, source = {}, MegatronSource(engine, attr="fp32_main")
    for hf in saved.values():
        tensor = source.read(hf)  # every rank, in the same order
        if tensor is not None:
            module, leaf = hf.rsplit(".", 1)
            out[f"{PEFT_PREFIX}{module}.modules_to_save.{ADAPTER}.{leaf}"] = tensor
    for param in params:
        del param.fp32_main
    return out


class MegatronSource(Source):
    """The engine's parameters as HF checkpoint tensors, read in HF order (every rank reads every
    name in the same order; the result is on rank 0). The HF tensors made from one megatron tensor
    are kept until another is needed (q, k and v come from one fused tensor)."""

    def __init__(self, engine, attr: str | None = None):
        from toolkit.adapters.export import fp32_config
        from toolkit.adapters.hf import empty_model
        from toolkit.families import table, unpacked_layout
        super().__init__(path=Path("."), format="engine", hf_config=fp32_config(engine.hf_config))
        self.engine, self.attr, self.collective = engine, attr, True
        shapes = {n: tuple(p.shape) for n, p in empty_model(engine.hf_config).named_parameters()}
        self.infos = {n: TensorInfo(piece.shape, torch.float32)
                      for n, piece in unpacked_layout(engine.family, engine.hf_config, shapes).items()}
        self.entries = {hp + hf: (mcore, e) for mcore, (e, hp) in table(engine.family, engine.hf_config).items()
                        for hf in e.hf_names()}
        self.local = owned_params(engine)
        self.sender = _senders(self.local)
        self._cached: tuple[str, dict] | None = None

    def read(self, name: str, state: str = "param") -> torch.Tensor | None:
        mcore, entry = self.entries[name]
        if self._cached is None or self._cached[0] != mcore:
            self._cached = None
            trim_heap()  # the previous tensor's pages back to the OS (toolkit/heap.py: else RSS grows)
            self._cached = (mcore, self._hf_tensors(mcore, entry, name))
        return self._cached[1].get(name)

    def _hf_tensors(self, mcore: str, entry, name: str) -> dict[str, torch.Tensor]:
        full = self._full(mcore)
        if dist.get_rank() != 0:
            return {}
        prefix = name[:len(name) - len(next(h for h in entry.hf_names() if name.endswith(h)))]
        dims = self.engine.family.dims(self.engine.hf_config, self.engine.lay.padded_vocab)
        return {prefix + k: v for k, v in entry.to_hf(full, dims).items()}

    def _full(self, mcore: str) -> torch.Tensor | None:
        """The unsharded tensor on global rank 0 (fp32, CPU); None elsewhere. Shards travel in the
        training dtype and become fp32 once, joined on rank 0: the transient is one tensor in the
        training dtype and its fp32 copy (``estimate/memory.py``'s host_export)."""
        full = self._gather_tp(mcore) if mcore in self.local else None
        sender = self.sender[mcore]
        if sender != 0 and dist.get_rank() == sender:
            _send(full, dst=0)
            full = None
        elif sender != 0 and dist.get_rank() == 0:
            full = _recv(src=sender)
        # a copy always: at TP=1 ``full`` is the live parameter, which later steps change in place
        return None if full is None else full.to("cpu", torch.float32, copy=True)

    def _gather_tp(self, mcore: str) -> torch.Tensor | None:
        """This TP group's shards of ``mcore`` on its TP rank 0, joined (training dtype)."""
        from toolkit.families import unshard
        t = self.local[mcore]
        t = (getattr(t, self.attr) if self.attr else t).detach().contiguous()
        group = _tp_group(mcore)
        size, me = dist.get_world_size(group), dist.get_rank(group)
        if size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(size)] if me == 0 else None
        dist.gather(t, parts, dst=dist.get_global_rank(group, 0), group=group)
        return unshard(self.engine.family, self.engine.hf_config, mcore, parts) if me == 0 else None


def owned_params(engine) -> dict[str, torch.Tensor]:
    """This rank's megatron tensors by global name, where it is in the replica an export takes."""
    out = {}
    for chunk in engine.model:
        offset, first_expert = layer_offset(chunk.module), expert_offset(chunk.module, engine.lay.ep)
        for name, t in local_params(chunk.module).items():
            name = global_name(name, offset, first_expert)
            if (engine.owns_experts if is_expert(name) else engine.owns_dense) and name not in out:
                out[name] = t
    if engine.family.tied(engine.hf_config):
        out.pop("output_layer.weight", None)  # the last stage's copy of the tied embedding
    return out


def _tp_group(mcore: str):
    return grid.tp_group(expert=is_expert(mcore))


def _senders(local: dict) -> dict[str, int]:
    """Global rank of the TP rank 0 that joins each tensor (one small all-gather of names)."""
    mine = [n for n in local if dist.get_rank(_tp_group(n)) == 0]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (dist.get_rank(), mine))
    return {name: rank for rank, names in every for name in names}


WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # a tensor's dtype, sent as its index


def _send(tensor: torch.Tensor, dst: int) -> None:
    header = list(tensor.shape) + [-1] * (MAX_DIMS - tensor.dim()) + [WIRE_DTYPES.index(tensor.dtype)]
    dist.send(device.tensor(header, dtype=torch.int64), dst=dst)
    dist.send(tensor.to(device.rank_device()), dst=dst)


def _recv(src: int) -> torch.Tensor:
    header = device.zeros(MAX_DIMS + 1, dtype=torch.int64)
    dist.recv(header, src=src)
    *shape, dtype = header.tolist()
    full = torch.empty([int(d) for d in shape if d >= 0], dtype=WIRE_DTYPES[dtype], device=device.rank_device())
    dist.recv(full, src=src)
    return full


class MergedLoraSource(MegatronSource):
    """A LoRA run's merged model onto a base that exists only in the engine (a random init): each
    adapted HF weight is W + scaling x B @ A in fp32 on rank 0, W gathered from the engine, A, B and
    each layer's scaling from ``trained`` and peft's meta ``model`` (rank 0; None elsewhere)."""

    def __init__(self, engine, model, trained: dict | None):
        from toolkit.lora.convert import merge_table
        super().__init__(engine)
        self.pairs = merge_table(model, trained)[0] if trained is not None else {}

    def _hf_tensors(self, mcore: str, entry, name: str) -> dict[str, torch.Tensor]:
        from toolkit.lora.peft import merged_weight
        return {n: merged_weight(t, *self.pairs[n]) if n in self.pairs else t
                for n, t in super()._hf_tensors(mcore, entry, name).items()}
