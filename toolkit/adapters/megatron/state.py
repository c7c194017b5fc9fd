"""The megatron engine's checkpoints: megatron-core ``torch_dist`` with the distributed optimizer in
its fully reshardable form (tensors keyed by global layer numbers, so any TP/PP/DP/EP loads them),
plus ``toolkit_megatron.json`` (true vocab, layer spec, layout)."""
from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from toolkit.compat import megatron_core
from toolkit.formats.describe import megatron_description, write_megatron_description


def model_sharded_state_dict(engine) -> dict:
    """``model`` (or ``model0``, ``model1``... per virtual stage, as Megatron-LM names them); a LoRA
    run's adapters only, under ``adapters`` (``lora.sharded_adapters``: HF-PEFT names)."""
    if engine.lora is not None:
        from toolkit.adapters.megatron.lora import sharded_adapters
        return {"adapters": sharded_adapters(engine)}
    return {"model" if len(engine.model) == 1 else f"model{i}": chunk.module.sharded_state_dict()
            for i, chunk in enumerate(engine.model)}


def _load_model(engine, loaded: dict) -> None:
    if engine.lora is not None:
        from toolkit.adapters.megatron.lora import load_adapters
        load_adapters(engine, loaded["adapters"])
        return
    for i, chunk in enumerate(engine.model):
        chunk.module.load_state_dict(loaded["model" if len(engine.model) == 1 else f"model{i}"], strict=True)


def sharded_state_dict(engine, is_loading: bool) -> dict:
    """The model's and the ``optimizer``'s."""
    sd = model_sharded_state_dict(engine)
    # chained_optim_avoid_prefix: with ep > 1 megatron chains a dense and an expert optimizer;
    # without it their keys would differ from ep = 1's and no other ep could load them.
    sd["optimizer"] = engine.optimizer.sharded_state_dict(
        dict(sd), is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fully_reshardable",
                                                   "chained_optim_avoid_prefix": True})
    return sd


def save(engine, path: Path) -> None:
    """Collective: every rank writes its shards."""
    from megatron.core import dist_checkpointing
    path = Path(path)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    megatron_core.in_process_write_results()
    megatron_core.materialize_optimizer_state(engine.optimizer)
    dist_checkpointing.save(sharded_state_dict(engine, is_loading=False), str(path))
    if dist.get_rank() == 0:  # after megatron's save, which warns about a folder not empty before it
        write_megatron_description(path, describe(engine))
    dist.barrier()


def load(engine, path: Path) -> None:
    """Collective; megatron reshards whatever layout wrote ``path``."""
    from megatron.core import dist_checkpointing
    if not holds_optimizer_state(path):  # `toolkit convert --weights-only`: Adam starts fresh
        load_weights_only(engine, path)
        return
    megatron_core.materialize_optimizer_state(engine.optimizer)
    megatron_core.tolerate_step_state(engine.optimizer)
    loaded = dist_checkpointing.load(sharded_state_dict(engine, is_loading=True), str(path))
    _load_model(engine, loaded)
    engine.optimizer.load_state_dict(megatron_core.param_groups_as_mine(engine.optimizer, loaded["optimizer"]))
    megatron_core.unshare_step_tensors(engine.optimizer)


def load_weights_only(engine, path: Path) -> None:
    """The model's tensors only; the optimizer keeps its fresh state (no moments, step 0) and takes
    its fp32 main weights from the loaded model."""
    from megatron.core import dist_checkpointing
    loaded = dist_checkpointing.load(model_sharded_state_dict(engine), str(path))
    _load_model(engine, loaded)
    engine.optimizer.reload_model_params()


def holds_optimizer_state(path: Path) -> bool:
    """Whether a torch_dist checkpoint has optimizer tensors (from its DCP metadata, no tensor read)."""
    from torch.distributed.checkpoint import FileSystemReader
    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return any(k.startswith("optimizer.") for k in keys)


def describe(engine) -> dict:
    """What a reader of the checkpoint needs: true vocab, layer spec, layout."""
    return megatron_description(engine.family.model_type, engine.hf_config.vocab_size, engine.lay.padded_vocab,
                                engine.lay.vocab_divisor, engine.layout_record(), lora=engine.lora is not None)
