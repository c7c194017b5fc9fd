"""The megatron engine's weights (or gradients) as full tensors: gathered to rank 0, unsharded
through the family table, and written as an HF ``save_pretrained`` directory."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

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
    """Collective: ``path`` as ``save_pretrained`` writes it, in fp32, from rank 0."""
    state = hf_state(engine)
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        from toolkit.families import pack
        model = AutoModelForCausalLM.from_config(engine.hf_config, dtype=torch.float32)
        model.load_state_dict(pack(engine.family, engine.hf_config, state), strict=True)
        model.save_pretrained(str(path), safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(path))
    dist.barrier()
