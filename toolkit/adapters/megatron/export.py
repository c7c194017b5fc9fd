"""The megatron engine's weights (or gradients) as full tensors: gathered to rank 0, unsharded
through the family table, and written as an HF ``save_pretrained`` directory."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from toolkit.convert.canonical import Source, TensorInfo

from toolkit.adapters.megatron.weights import _global_name, _local_params, expert_offset, is_expert, layer_offset


def full_mcore_state(engine, attr: str | None = None) -> dict[str, torch.Tensor] | None:
    """Full (unsharded, global layer numbers) mcore tensors, on global rank 0; None elsewhere.
    ``attr="main_grad"``: the gradients instead of the weights (complete at dp=1, or after
    ``forward_backward(..., complete_grads=True)``)."""
    local = {}
    for chunk in engine.model:
        offset, first_expert = layer_offset(chunk.module), expert_offset(chunk.module)
        for name, t in _local_params(chunk.module).items():
            name = _global_name(name, offset, first_expert)
            if not (engine.owns_experts if is_expert(name) else engine.owns_dense):
                continue  # another DP (or expert-DP) replica's copy is taken
            t = getattr(t, attr) if attr else t
            local[name] = t.detach().to("cpu", torch.float32).clone()
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((engine.tp_rank, local), gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    return _merge(engine, gathered)


def _merge(engine, gathered) -> dict[str, torch.Tensor]:
    from toolkit.families import unshard
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for tp_rank, local in gathered:
        for name, t in local.items():
            parts.setdefault(name, {})[tp_rank] = t
    full = {}
    for name, by_rank in parts.items():
        if name == "output_layer.weight" and engine.family.tied(engine.hf_config):
            continue  # the last stage's copy of the tied embedding
        full[name] = unshard(engine.family, engine.hf_config, name, [by_rank[r] for r in sorted(by_rank)])
    return full


def hf_state(engine, attr: str | None = None) -> dict[str, torch.Tensor] | None:
    """The current weights (or ``attr`` of them) as an HF state dict on rank 0, strict through the
    family table."""
    from toolkit.families import mcore_to_hf
    full = full_mcore_state(engine, attr)
    return None if full is None else mcore_to_hf(engine.family, engine.hf_config, full, engine.lay.padded_vocab)


def export_hf(engine, path: Path, tokenizer) -> None:
    """Collective: ``path`` as the converter's HF writer writes it (fp32, checkpoint names), one
    megatron tensor at a time: its TP shards gathered to rank 0, unsharded, mapped to HF names."""
    from toolkit.adapters.export import write_streamed
    write_streamed(MegatronSource(engine), path, tokenizer)


class MegatronSource(Source):
    """The engine's weights as HF checkpoint tensors, read in HF order. Reads are collective: the
    ranks holding the megatron tensor (its pipeline stage, every TP rank, one DP replica) send their
    shards to rank 0, which keeps the HF tensors made from it until another one is needed (q, k
    and v come from one fused tensor)."""

    def __init__(self, engine):
        from toolkit.adapters.hf import empty_model
        from toolkit.adapters.export import _config_dict
        from toolkit.families import table, unpacked_layout
        super().__init__(path=Path("."), format="engine", hf_config=_config_dict(engine.hf_config))
        self.engine, self.collective = engine, True
        shapes = {n: tuple(p.shape) for n, p in empty_model(engine.hf_config).named_parameters()}
        layout = unpacked_layout(engine.family, engine.hf_config, shapes)
        self.infos = {n: TensorInfo(piece.shape, torch.float32) for n, piece in layout.items()}
        self.entries = {hp + hf: (mcore, e) for mcore, (e, hp) in table(engine.family, engine.hf_config).items()
                        for hf in e.hf_names()}
        self.local = _owned_params(engine)
        self._cached: tuple[str, dict] | None = None

    def read(self, name: str, state: str = "param") -> torch.Tensor | None:
        mcore, entry = self.entries[name]
        if self._cached is None or self._cached[0] != mcore:
            self._cached = (mcore, self._hf_tensors(mcore, entry, name))
        return self._cached[1].get(name)

    def _hf_tensors(self, mcore: str, entry, name: str) -> dict[str, torch.Tensor]:
        from toolkit.families import unshard
        engine = self.engine
        mine = self.local.get(mcore)
        part = None if mine is None else (engine.tp_rank, mine.detach().to("cpu", torch.float32).clone())
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(part, gathered, dst=0)
        if dist.get_rank() != 0:
            return {}
        shards = dict(p for p in gathered if p is not None)
        full = unshard(engine.family, engine.hf_config, mcore, [shards[r] for r in sorted(shards)])
        prefix = name[:len(name) - len(next(h for h in entry.hf_names() if name.endswith(h)))]
        dims = engine.family.dims(engine.hf_config, engine.lay.padded_vocab)
        return {prefix + k: v for k, v in entry.to_hf(full, dims).items()}


def _owned_params(engine) -> dict[str, torch.Tensor]:
    """This rank's megatron tensors by global name, where it is the replica an export takes."""
    out = {}
    for chunk in engine.model:
        offset, first_expert = layer_offset(chunk.module), expert_offset(chunk.module)
        for name, t in _local_params(chunk.module).items():
            name = _global_name(name, offset, first_expert)
            if (engine.owns_experts if is_expert(name) else engine.owns_dense) and name not in out:
                out[name] = t
    if engine.family.tied(engine.hf_config):
        out.pop("output_layer.weight", None)  # the last stage's copy of the tied embedding
    return out
