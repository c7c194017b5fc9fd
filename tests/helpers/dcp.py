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


# --- sources trained on past a checkpoint, and a plain FSDP2 loop resuming from their DCP conversion ------

NEXT = 2
"""Steps the source run takes after its checkpoint, and the resumed FSDP2 loop after loading it."""
MEGATRON_LR = 1e-3


def zero2_run(rank: int, world: int, root: str, steps: int) -> list[float]:
    """Rank body: DeepSpeed ZeRO-2 on this many DP ranks (``tests.helpers.convert``'s engine: AdamW
    lr 1e-2, betas (0.9, 0.95), clipping 1.0, matrices decayed 0.1), ``steps`` steps,
    ``save_checkpoint``, then ``NEXT`` more: this rank's losses of those."""
    from tests.helpers.convert import _engine, _step
    engine = _engine("llama", 2, world)
    vocab = engine.module.config.vocab_size
    for s in range(steps):
        _step(engine, rank, vocab, s)
    engine.save_checkpoint(root, tag=f"global_step{steps}")
    if rank == 0:
        engine.module.config.to_json_file(str(Path(root) / "config.json"))
    losses = [_step(engine, rank, vocab, s) for s in range(steps, steps + NEXT)]
    engine.destroy()
    return losses


def zero2_batches(world: int, vocab: int, steps: int) -> list[list[dict]]:
    """The batches ``zero2_run``'s ranks take after its checkpoint, per step (one micro-batch per DP rank)."""
    from tests.helpers.convert import step_batch
    return [[{"input_ids": step_batch(r, vocab, s)} for r in range(world)] for s in range(steps, steps + NEXT)]


def megatron_config(tp: int):
    from toolkit.config import validate
    return validate({"backend": "megatron", "megatron": {"tp": tp, "pp": 1},
                     "train": {"global_batch_size": 2, "micro_batch_size": 1, "weight_decay": 0.1}})


def megatron_batches(vocab: int, steps: int) -> list[list[dict]]:
    from tests.helpers.parity import batches
    return [batches(vocab, n_micro=2, seed=s) for s in range(steps, steps + NEXT)]


def megatron_run(rank: int, world: int, family: str, path: str, steps: int) -> list[float]:
    """Rank body: the toolkit's megatron-core engine at TP ``world`` (megatron's distributed Adam),
    ``steps`` steps, its own ``dist_checkpointing`` save, then ``NEXT`` more: their losses."""
    from tests.helpers.parity import batches
    from tests.helpers.ranks import megatron_engine, release_megatron
    from toolkit.families.tiny import tiny_model
    from toolkit.loss import IGNORE_INDEX
    model = tiny_model(family)
    engine = megatron_engine(megatron_config(world), model)
    vocab = model.config.vocab_size

    def step(s: int) -> float:
        micro = batches(vocab, n_micro=2, seed=s)
        return engine.train_step(micro, sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro),
                                 MEGATRON_LR).loss
    for s in range(steps):
        step(s)
    engine.save(Path(path), steps)
    losses = [step(s) for s in range(steps, steps + NEXT)]
    release_megatron()
    return losses


def fsdp2_resume(rank: int, world: int, family: str, ckpt: str, steps: list[list[dict]], hparams: dict) -> dict:
    """Rank body: a plain FSDP2 loop (each decoder layer, then the root; ``torch.optim.AdamW`` over
    the toolkit's decay groups, gradient clipping) from a fresh init of another seed; ``dcp.load`` +
    ``set_model_state_dict`` / ``set_optimizer_state_dict`` of ``ckpt``, then one step per entry of
    ``steps`` (every rank the same micro-batches: the whole global batch), each at ``hparams["lr"]``.
    The loss of a step: micro-batches with ``labels`` as the toolkit counts it (sum of token losses /
    tokens), without as DeepSpeed's DP ranks do (the mean of HF's mean losses). Returns the losses
    and the optimizer's loaded step and groups."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    from toolkit.adapters.hf import param_groups
    from toolkit.families.tiny import tiny_model
    from toolkit.loss import IGNORE_INDEX, token_loss_sum
    model = tiny_model(family, seed=99).train()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(param_groups(model, hparams["weight_decay"]), lr=hparams["lr"], betas=hparams["betas"],
                            eps=hparams["eps"])
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=ckpt)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    loaded = {"step": sorted({float(s["step"]) for s in opt.state.values()}),
              "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]}
    losses = []
    for micro in steps:
        for group in opt.param_groups:
            group["lr"] = hparams["lr"]
        if "labels" in micro[0]:
            tokens = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro)
            parts = [token_loss_sum(model(input_ids=mb["input_ids"]).logits, mb["labels"])[0] / tokens for mb in micro]
        else:
            parts = [model(input_ids=mb["input_ids"], labels=mb["input_ids"]).loss / len(micro) for mb in micro]
        loss = sum(parts)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, **loaded}


# --- accelerate / HF Trainer FSDP2 checkpoints ----------------------------------------------------------

def accelerate_state():
    """accelerate's ``PartialState`` of this gloo job: what its ``save_fsdp_*`` / ``load_fsdp_*`` use of
    an ``Accelerator`` for a sharded FSDP2 state dict (rank, world, barrier). A whole ``Accelerator``
    in FSDP mode (and so HF Trainer's FSDP) does not run on CPU: accelerate 1.16 makes
    ``DistributedType.FSDP`` only out of the GPU-type distributed types (``accelerate/state.py``:
    MULTI_CPU never becomes FSDP), and HF Trainer then refuses ``fsdp`` ("Using fsdp only works in
    distributed training"). Everything the checkpoint is made of is accelerate's own: its FSDP2
    plugin and its save and load functions, which call torch DCP."""
    from accelerate import PartialState
    return PartialState(cpu=True)


def fsdp2_plugin():
    from accelerate.utils import FullyShardedDataParallelPlugin
    return FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")


def _fsdp2_model(family: str, seed: int = 0):
    from torch.distributed.fsdp import fully_shard

    from toolkit.families.tiny import tiny_model
    model = tiny_model(family, seed=seed).train()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _hf_step(model, opt, ids: torch.Tensor) -> float:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _cloned(state):
    """A copy: on one rank a full state dict's tensors are the live parameters and moments."""
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: _cloned(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_cloned(v) for v in state]
    return state


def accelerate_batch(step: int, vocab: int) -> torch.Tensor:
    """The global batch of step ``step`` (every rank takes all of it: the gradient is the batch's)."""
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1000 + step))


def save_accelerate(rank: int, world: int, family: str, out: str) -> dict:
    """Rank body: FSDP2 + AdamW (torch's, the toolkit's decay groups) ``STEPS`` steps, then accelerate's
    own ``save_fsdp_model`` / ``save_fsdp_optimizer`` into ``out`` (an HF Trainer ``checkpoint-N/``),
    then ``NEXT`` more steps. Rank 0 returns the full state dicts at the save and the next losses."""
    from accelerate.utils.fsdp_utils import save_fsdp_model, save_fsdp_optimizer
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    from toolkit.adapters.hf import param_groups
    model = _fsdp2_model(family)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2, betas=(0.9, 0.95))
    vocab = model.config.vocab_size
    for s in range(STEPS):
        _hf_step(model, opt, accelerate_batch(s, vocab))
    plugin, accelerator = fsdp2_plugin(), accelerate_state()
    save_fsdp_model(plugin, accelerator, model, out)
    save_fsdp_optimizer(plugin, accelerator, opt, model, out)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    reference = _cloned({"model": get_model_state_dict(model, options=full),
                         "optim": get_optimizer_state_dict(model, opt, options=full)})
    losses = [_hf_step(model, opt, accelerate_batch(s, vocab)) for s in range(STEPS, STEPS + NEXT)]
    return {**reference, "losses": losses} if rank == 0 else None


def resume_accelerate(rank: int, world: int, family: str, ckpt: str) -> dict:
    """Rank body: a fresh FSDP2 model (another seed) and AdamW resumed by accelerate's own
    ``load_fsdp_model`` / ``load_fsdp_optimizer`` from ``ckpt``, then ``NEXT`` steps: their losses
    and the loaded full state dicts (rank 0)."""
    from accelerate.utils.fsdp_utils import load_fsdp_model, load_fsdp_optimizer
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    from toolkit.adapters.hf import param_groups
    model = _fsdp2_model(family, seed=99)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2, betas=(0.9, 0.95))
    plugin, accelerator = fsdp2_plugin(), accelerate_state()
    load_fsdp_model(plugin, accelerator, model, ckpt)
    load_fsdp_optimizer(plugin, accelerator, opt, model, ckpt)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    loaded = _cloned({"model": get_model_state_dict(model, options=full),
                      "optim": get_optimizer_state_dict(model, opt, options=full)})
    vocab = model.config.vocab_size
    losses = [_hf_step(model, opt, accelerate_batch(s, vocab)) for s in range(STEPS, STEPS + NEXT)]
    return {**loaded, "losses": losses} if rank == 0 else None


def build_accelerate_checkpoint(tmp_path: Path, family: str = "llama", world: int = 2) -> tuple[Path, dict]:
    """(``OUTPUT/checkpoint-STEPS``, rank 0's reference) of a ``world``-rank FSDP2 run saved by
    accelerate, with ``trainer_state.json`` (a transformers ``TrainerState``) and the model's
    ``config.json`` in the Trainer's output directory (a sharded FSDP save writes none into the checkpoint)."""
    from transformers.trainer_callback import TrainerState

    from toolkit.families.tiny import tiny_config
    ckpt = tmp_path / "output" / f"checkpoint-{STEPS}"
    reference = run_ranks(save_accelerate, world, tmp_path, family, str(ckpt))[0]
    TrainerState(global_step=STEPS).save_to_json(str(ckpt / "trainer_state.json"))
    tiny_config(family).to_json_file(tmp_path / "output" / "config.json")
    return ckpt, reference


# --- an FSDP2 run on the toolkit's data, continued by the toolkit after a conversion ---------------------

def toolkit_global_batches(cfg, steps: int) -> list[dict]:
    """The global batches ``{"input_ids", "labels"}`` ``[G, seq]`` of a toolkit run's first ``steps``
    steps (``toolkit.data``: rows by (seed, step), whatever the layout)."""
    from toolkit.data import global_batch_indices, load_tokenizer, prepare_data
    ds = prepare_data(cfg, load_tokenizer(cfg)).train.with_format("torch", columns=["input_ids", "labels"])
    t = cfg.train
    return [dict(ds[global_batch_indices(len(ds), t.global_batch_size, t.seed, s)]) for s in range(steps)]


def fsdp2_toolkit_run(rank: int, world: int, config_dir: str, batches: list[dict], lrs: list[float], hparams: dict,
                      save_at: int, out: str) -> list[float]:
    """Rank body: a plain FSDP2 run (``fully_shard`` per decoder layer and the root, ``torch.optim.AdamW``
    over the toolkit's decay groups, gradient clipping 1.0) of the model in ``config_dir`` on the
    global ``batches``, DP rank r taking the r-th slice, the loss a toolkit run's (sum of token losses /
    the global batch's loss tokens) at ``lrs[step]``. After ``save_at`` steps it saves
    ``{"model": get_model_state_dict, "optim": get_optimizer_state_dict}`` with ``dcp.save`` and runs
    on: every step's loss."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.adapters.hf import param_groups
    from toolkit.loss import IGNORE_INDEX, token_loss_sum
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.float32).train()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(param_groups(model, hparams["weight_decay"]), lr=lrs[0], betas=hparams["betas"],
                            eps=hparams["eps"])
    losses = []
    for step, (batch, lr) in enumerate(zip(batches, lrs)):
        if step == save_at:
            dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                     checkpoint_id=out)
        for group in opt.param_groups:
            group["lr"] = lr
        tokens = int((batch["labels"] != IGNORE_INDEX).sum())
        mine = slice(rank * len(batch["labels"]) // world, (rank + 1) * len(batch["labels"]) // world)
        loss_sum, _ = token_loss_sum(model(input_ids=batch["input_ids"][mine]).logits, batch["labels"][mine])
        (loss_sum * world / tokens).backward()  # FSDP2 averages the ranks' gradients: their sum is the batch's
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        total = loss_sum.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / tokens)
    return losses


# --- an FSDP2 model wrapped by peft (LoRA), saved with DCP ---------------------------------------------

PEFT_TARGETS = ["q_proj", "v_proj"]


def save_fsdp2_peft_dcp(rank: int, world: int, family: str, out: str, base: str) -> dict | None:
    """Rank body: peft's ``get_peft_model`` (LoRA r 4, alpha 8 on ``PEFT_TARGETS``, ``lm_head`` trained in
    full as a module to save) of a tiny HF model, then FSDP2 (each decoder layer, then the root),
    AdamW on the trained tensors, ``STEPS`` steps,
    ``dcp.save({"model": get_model_state_dict, "optim": get_optimizer_state_dict})``; rank 0 saves
    the base (``save_pretrained``, before wrapping) to ``base`` and peft's adapter_config.json beside
    the DCP (as HF Trainer does), and returns the full model state dict and the FSDP2 peft model's
    logits on a fixed batch: the reference."""
    import torch.distributed.checkpoint as dcp
    from peft import LoraConfig, get_peft_model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    from toolkit.families.tiny import tiny_model
    model = tiny_model(family).train()
    if rank == 0:
        model.save_pretrained(base)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=PEFT_TARGETS, lora_dropout=0.0,
                                            modules_to_save=["lm_head"]))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    torch.manual_seed(100 + rank)
    vocab = model.config.vocab_size
    for _ in range(STEPS):
        ids = torch.randint(0, vocab, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=out)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=peft_batch(vocab)).logits
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        config = model.peft_config["default"]
        config.base_model_name_or_path = base
        config.save_pretrained(out)
        return {"model": full, "logits": logits}
    return None


def peft_batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))


def build_fsdp2_peft_dcp(tmp_path: Path, family: str = "llama", world: int = 2) -> tuple[Path, Path, dict]:
    """(DCP directory with adapter_config.json, the base's HF directory, rank 0's reference)."""
    ckpt, base = tmp_path / "dcp", tmp_path / "base"
    reference = run_ranks(save_fsdp2_peft_dcp, world, tmp_path, family, str(ckpt), str(base))[0]
    return ckpt, base, reference
