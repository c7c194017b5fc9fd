"""FSDP2 checkpoints written by PyTorch itself: a tiny HF model under ``fully_shard`` on gloo ranks,
trained a few AdamW steps, saved with ``torch.distributed.checkpoint`` as FSDP2 users save it."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.ranks import run_ranks

STEPS = 2


def save_fsdp2_dcp(rank: int, world: int, family: str, out: str) -> dict | None:
    """Rank body: FSDP2 (each decoder layer, then the root) + AdamW, ``STEPS`` steps on rank-seeded
    batches, ``dcp.save({"model": get_model_state_dict, "optim": get_optimizer_state_dict})``. Rank 0
    returns the full (gathered) model and optimizer state dicts as PyTorch gives them: the reference."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    from toolkit.families.tiny import tiny_model
    model = tiny_model(family).train()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    torch.manual_seed(100 + rank)
    for _ in range(STEPS):
        ids = torch.randint(0, model.config.vocab_size, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=out)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    reference = {"model": get_model_state_dict(model, options=full),
                 "optim": get_optimizer_state_dict(model, opt, options=full)}
    return reference if rank == 0 else None


def build_fsdp2_dcp(tmp_path: Path, family: str = "llama", world: int = 2) -> tuple[Path, Path, dict]:
    """(DCP directory, its HF config.json, rank 0's full state dicts) of a ``world``-rank FSDP2 run."""
    from toolkit.families.tiny import tiny_config
    ckpt, config = tmp_path / "dcp", tmp_path / "config.json"
    reference = run_ranks(save_fsdp2_dcp, world, tmp_path, family, str(ckpt))[0]
    tiny_config(family).to_json_file(config)
    return ckpt, config, reference


def save_megatron_engine(rank: int, world: int, family: str, path: str) -> None:
    """Rank body: a megatron-core engine at TP ``world`` saves untrained through its own
    ``dist_checkpointing`` (torch_dist: a DCP directory whose ``.metadata`` also holds the save plans)."""
    from tests.helpers.ranks import megatron_engine
    from toolkit.config import validate
    from toolkit.families.tiny import tiny_model
    config = validate({"backend": "megatron", "megatron": {"tp": world, "pp": 1},
                       "train": {"global_batch_size": 4, "micro_batch_size": 2}})
    megatron_engine(config, tiny_model(family)).save(path, 0)
